"""OpenAI's request shapes for `llama.serve`: the request bodies (checked by pydantic: unknown fields are errors),
vLLM's tokenizer bodies, errors, and the prompts, dialogs and response formats that requests turn into. No HTTP
here; the answers' shapes are `llama.openai_answers`'.
"""

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from llama.checks import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.tokenizer import ROLES as LLAMA_ROLES
from llama.tokenizer import ChatFormat, Message, Tokenizer
from llama.tools import tool_messages

MAX_STOP_CHARS = 256  # the text held back while it could begin a stop string is shorter than this
MAX_N = 8  # samples of one prompt in a request
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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorBody(BaseModel):
    """Every error's body, as OpenAI's API gives it (`APIError.body`)."""

    error: ErrorDetail


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
    role: Literal[ROLES]  # type: ignore[valid-type]
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


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: Optional[str] = None
    schema_: Dict[str, Any] = Field(default_factory=dict, alias="schema")  # the JSON schema the answer must follow
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON that `json_schema.schema` validates."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None

    def as_dict(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """A `tool_choice` that names the function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


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
    response_format: Optional[ResponseFormat] = None  # decode under a grammar (llama.structured)
    n: int = Field(1, ge=1, le=MAX_N)  # samples of each prompt; they share its prefill (seed s: s, s + 1, ...)
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
    tool_choice: Union[Literal["auto", "none"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None


class CompletionRequest(Sampling):
    # A text, texts, token IDs or lists of token IDs: one choice (n choices) each.
    prompt: Union[str, List[str], List[StrictInt], List[List[StrictInt]]]
    max_tokens: Optional[int] = Field(16, ge=0)  # OpenAI's default for completions; 0 with echo scores the prompt
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False


def completion_prompts(prompt, tokenizer: Tokenizer, vocab_size: int) -> List[List[int]]:
    """A completion request's `prompt` as token-ID lists, texts encoded as `Llama.text_completion` encodes them
    (<|begin_of_text|> first). Raises APIError (400) for no prompt, an empty one, or a token ID outside the
    vocabulary, naming which."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: send a text, texts, token IDs or lists of token IDs", "prompt")
    prompts = []
    for i, one in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if not one:
            raise APIError(400, f"{where} is empty: give every prompt at least one token", where)
        if isinstance(one, str):
            prompts.append(tokenizer.encode(one, bos=True, eos=False))
            continue
        check_in_vocabulary(one, vocab_size, where)
        prompts.append(list(one))
    return prompts


def check_in_vocabulary(tokens: List[int], vocab_size: int, where: str) -> None:
    """Raises APIError (400, param `where`) naming the first of `tokens` (ints: pydantic checked the type) outside
    the vocabulary, as `where[k]`."""
    bad = next((k for k, token in enumerate(tokens) if not 0 <= token < vocab_size), None)
    if bad is not None:
        message = f"{where}[{bad}] is token ID {tokens[bad]}, outside the vocabulary (0 to {vocab_size - 1})"
        raise APIError(400, message, where)


class TokenizePrompt(Strict):
    """vLLM's /tokenize body for a text, encoded as a completion's prompt (`add_special_tokens`: <|begin_of_text|>
    first)."""

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    """vLLM's /tokenize body for chat messages, written as a chat completion writes them: the assistant's header
    after them when `add_generation_prompt`, the last message left open when `continue_final_message`. The chat
    format has its own <|begin_of_text|>; `add_special_tokens` adds nothing more."""

    model: Optional[str] = None
    messages: List[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Optional[List[ToolSpec]] = None


class DetokenizeRequest(Strict):
    model: Optional[str] = None
    tokens: List[StrictInt]


def tokenize(request: Union[TokenizePrompt, TokenizeChat], formatter: ChatFormat) -> List[int]:
    """The token IDs of a /tokenize request. Raises APIError (400) for messages that cannot be written."""
    if isinstance(request, TokenizePrompt):
        return formatter.tokenizer.encode(request.prompt, bos=request.add_special_tokens, eos=False)
    chat = ChatRequest(model=request.model or "", messages=request.messages, tools=request.tools)
    dialog = dialog_of(chat, formatter)
    if request.add_generation_prompt and not request.continue_final_message:
        return formatter.encode_dialog_prompt(dialog)
    tokens = [formatter.tokenizer.special_tokens["<|begin_of_text|>"]]
    for message in dialog:
        tokens += formatter.encode_message(message)
    return tokens[:-1] if request.continue_final_message else tokens  # open: without its end-of-turn token


def answer_format(request: Sampling) -> Optional[dict]:
    """The `response_format` (as `llama.structured.Grammar.from_response_format` takes it) that a request's answer
    must follow: its own, or, where a chat request's `tool_choice` names a function, a call of that function as
    Llama 3.1 writes one, its arguments following the function's parameters. None: free text."""
    choice = getattr(request, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        functions = {tool.function.name: tool.function for tool in request.tools or []}
        if choice.function.name not in functions:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        call = {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "name": {"const": choice.function.name},
                "parameters": functions[choice.function.name].parameters or {"type": "object"},
            },
            "required": ["type", "name", "parameters"],
            "additionalProperties": False,
        }
        return {"type": "json_schema", "json_schema": {"name": choice.function.name, "schema": call}}
    return None if request.response_format is None else request.response_format.as_dict()


def dialog_of(request: ChatRequest, formatter: ChatFormat) -> List[Message]:
    """The request's messages as a llama dialog, after the messages that offer its tools, if any.

    A "developer" message is a system message; a leading system message becomes the tools' system prompt's
    instruction. Raises APIError (400) naming the message that cannot be written.
    """
    dialog: List[Message] = []
    for i, message in enumerate(request.messages):
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
