"""OpenAI's API shapes for `llama.serve`: the request bodies (checked by pydantic: unknown fields are errors), the
prompts they turn into, and the text, logprobs and tool calls of the answers. No HTTP here.
"""

import codecs
import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from llama.checks import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.engine import Output
from llama.tokenizer import ROLES as LLAMA_ROLES
from llama.tokenizer import ChatFormat, Message, Tokenizer
from llama.tools import tool_messages

MAX_STOP_CHARS = 256  # the text held back while it could begin a stop string is shorter than this
# OpenAI's message roles: Llama 3.1's, with a tool's output named "tool" only, plus "developer", OpenAI's newer
# name for a system message.
ROLES = (*(role for role in LLAMA_ROLES["3.1"] if role != "ipython"), "developer")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error answered as OpenAI answers it: HTTP `status` and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI writes it


class ToolCallSpec(Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: str
    content: Union[str, List[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallSpec]] = None
    tool_call_id: Optional[str] = None


class FunctionSpec(Strict):
    name: str
    description: str = ""
    parameters: Dict[str, Any] = Field(default_factory=dict)  # a JSON schema of type "object"
    strict: Optional[bool] = None


class ToolSpec(Strict):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The fields both endpoints take."""

    model: str
    # The defaults of Llama.chat_completion and Llama.text_completion, not OpenAI's (1.0 and 1.0).
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0, allow_inf_nan=False)
    top_p: float = Field(DEFAULT_TOP_P, gt=0, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Literal[1] = 1
    user: Optional[str] = None

    def stop_strings(self) -> List[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop takes at most 4 strings of 1 to {MAX_STOP_CHARS} characters", param="stop")
        return stops


class ChatRequest(Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[ToolSpec]] = None
    tool_choice: Optional[Literal["auto", "none"]] = None
    parallel_tool_calls: Optional[bool] = None


class CompletionRequest(Sampling):
    prompt: Union[str, List[str]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False


def dialog_of(request: ChatRequest, formatter: ChatFormat) -> List[Message]:
    """The request's messages as a llama dialog, after the messages that offer its tools, if any.

    A "developer" message is a system message; a leading system message becomes the tools' system prompt's
    instruction. Raises APIError (400) naming the message that cannot be written.
    """
    dialog: List[Message] = []
    for i, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise APIError(400, f"Unknown role {message.role!r}; use one of {list(ROLES)}", f"messages[{i}].role")
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None and not message.tool_calls:
            raise APIError(400, f"Message {i} has no content", f"messages[{i}].content")
        converted: Message = {
            "role": "system" if message.role == "developer" else message.role,
            "content": content or "",
        }
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(400, "Only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            converted["tool_calls"] = [tool_call_in(call, i) for call in message.tool_calls]
        dialog.append(converted)
    offered = request.tools if request.tool_choice != "none" else None
    if offered or any(m["role"] == "tool" or m.get("tool_calls") for m in dialog):
        if formatter.tokenizer.version == "3":
            raise APIError(400, "Tools need a Llama 3.1 or later checkpoint; this model has Llama 3 tokens", "tools")
    if offered:
        instruction = dialog.pop(0)["content"] if dialog and dialog[0]["role"] == "system" else None
        try:
            dialog = tool_messages([tool_definition(tool) for tool in offered], instruction=instruction) + dialog
        except ValueError as e:
            raise APIError(400, str(e), "tools") from None
    return dialog


def tool_call_in(call: ToolCallSpec, i: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, "tool_calls arguments must be a JSON object", f"messages[{i}].tool_calls")
    return {"tool_name": call.function.name, "arguments": arguments, "call_id": call.id or ""}


def tool_definition(tool: ToolSpec) -> dict:
    """An OpenAI function (its parameters a JSON schema) as llama's ToolDefinition."""
    schema = tool.function.parameters
    required = set(schema.get("required", []))
    parameters = {
        name: {
            "param_type": str(spec.get("type", "string")),
            "description": str(spec.get("description", "")),
            "required": name in required,
        }
        for name, spec in schema.get("properties", {}).items()
    }
    return {"name": tool.function.name, "description": tool.function.description, "parameters": parameters}


def tool_calls_out(text: str, stop_reason: str, formatter: ChatFormat) -> Optional[List[dict]]:
    """The calls an answer makes, in OpenAI's shape, or None (Llama 3 tokens, or plain text)."""
    if formatter.tokenizer.version == "3":
        return None
    calls = formatter.decode_assistant_message_from_content(text, stop_reason)["tool_calls"]
    return [
        {
            "id": call["call_id"],
            "type": "function",
            "function": {"name": call["tool_name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in calls
    ] or None


class AnswerText:
    """An answer's text as its tokens arrive: whole UTF-8 characters only, cut at the first stop string.

    Text that could be the start of a stop string (the last len(longest stop) - 1 characters) is held back until
    the next token settles it. A stop string that ends in a token's text begins in that text or in the held-back
    part, so each token's search covers only those two: linear in the answer's length.
    """

    def __init__(self, tokenizer: Tokenizer, stops: List[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.held = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Take a token; return the text now safe to send."""
        return self.settle(self.held + self.decoder.decode(self.tokenizer.decode_bytes([token])), final=False)

    def flush(self) -> str:
        """The rest of the text, at the end."""
        return "" if self.stopped else self.settle(self.held + self.decoder.decode(b"", final=True), final=True)

    def settle(self, text: str, final: bool) -> str:
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.held, self.stopped = "", True
            return text[: min(found)]
        cut = len(text) if final else max(0, len(text) - self.keep)
        self.held = text[cut:]
        return text[:cut]


def finish_reason(finish: str) -> str:
    """OpenAI's finish_reason for an engine finish."""
    return "length" if finish == "length" else "stop"


def chat_logprobs(outputs: List[Output], tokenizer: Tokenizer) -> Optional[dict]:
    """Chat's "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} per token."""
    return {"content": [logprob_entry(o.token, o.logprob, o.top_logprobs, tokenizer) for o in outputs]}


def logprob_entry(token: int, logprob: float, top: Optional[list], tokenizer: Tokenizer) -> dict:
    raw = tokenizer.decode_bytes([token])
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(raw),
        "top_logprobs": [logprob_entry(t, lp, None, tokenizer) for t, lp in top or []] if top is not None else [],
    }


def completion_logprobs(outputs: List[Output], tokenizer: Tokenizer, offset: int) -> dict:
    """Completions' legacy "logprobs": tokens, token_logprobs, top_logprobs and text_offset, from `offset`."""
    tokens = [tokenizer.decode([o.token]) for o in outputs]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [o.logprob for o in outputs],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in o.top_logprobs or []} for o in outputs],
        "text_offset": offsets,
    }
