"""The protocol: OpenAI's and vLLM's request shapes (the bodies, checked by pydantic: unknown fields are errors; vLLM's
tokenizer bodies; errors), then the shapes of an answer's parts (logprobs in chat's and the completions' legacy form,
tool calls). No HTTP here (`llama.serve.app`), and no conversion of a request into
prompts (`llama.serve.prompts`).
"""

import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag

from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.serve.requests import Output
from llama.text import tool_call_message
from llama.tokenizer import ROLES as LLAMA_ROLES
from llama.tokenizer import ChatFormat, Tokenizer

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


class ImageURL(Strict):
    url: str  # a data: URL with the image file in base64 (`llama.serve.data_urls`); this server fetches nothing
    # Taken for OpenAI's clients and ignored: Llama 3.2 Vision sees every image the same way, fitted into at most
    # four 560-pixel tiles (`llama.vision.images`), so there is no cheaper or finer reading to choose.
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(Strict):
    """OpenAI's image content part (Llama 3.2 Vision): it stands in the prompt as one `<|image|>`."""

    type: Literal["image_url"]
    image_url: ImageURL


# A part's "type" picks its shape, so a bad part's error names that shape's missing or unknown field, or the types
# there are; likewise a list is read as parts only, so its error is not that it should have been a string.
ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


def content_kind(content: Any) -> Optional[str]:
    """Which shape of `Content` a message's content has: "text", "parts", or None for neither."""
    return "text" if isinstance(content, str) else "parts" if isinstance(content, list) else None


Content = Annotated[
    Union[Annotated[str, Tag("text")], Annotated[List[ContentPart], Tag("parts")]],
    Discriminator(
        content_kind,
        custom_error_type="content_type",
        custom_error_message="Content must be a string or a list of parts",
    ),
]


class ChatMessage(Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Optional[Content] = None
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
    response_format: Optional[ResponseFormat] = None  # decode under a grammar (llama.decoding.grammar)
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


# The shapes of answers' parts --------------------------------------------------------------------------------


def tool_calls_out(text: str, stop_reason: str, formatter: ChatFormat) -> Optional[List[dict]]:
    """The calls an answer makes (`llama.text.tool_call_message`), in OpenAI's shape, or None."""
    message = tool_call_message(formatter, text, stop_reason)
    if message is None:
        return None
    return [
        {
            "id": call["call_id"],
            "type": "function",
            "function": {"name": call["tool_name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in message["tool_calls"]
    ]


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


def echoed_text(prompt: List[int], tokenizer: Tokenizer) -> str:
    """A prompt's text as `echo` shows it: without the <|begin_of_text|> that a text prompt gets and never shows."""
    return tokenizer.decode(prompt[1:] if prompt[0] == tokenizer.bos_id else prompt)


def prompt_logprobs(prompt: List[int], scores: list, tokenizer: Tokenizer, offset: int) -> dict:
    """Completions' legacy "logprobs" of a scored prompt (`Output.prompt_logprobs`), from text offset `offset`: the
    first token's logprob and top_logprobs are null, as OpenAI gives them. A leading <|begin_of_text|> is listed
    (it was scored as the context of the rest) but takes no room in the text."""
    tokens = [tokenizer.decode([t]) for t in prompt]
    offsets = text_offsets(tokens, offset)
    if prompt[0] == tokenizer.bos_id:
        offsets = [offset] + text_offsets(tokens[1:], offset)
    return {
        "tokens": tokens,
        "token_logprobs": [None if score is None else score[0] for score in scores],
        "top_logprobs": [None if s is None else {tokenizer.decode([t]): lp for t, lp in s[1]} for s in scores],
        "text_offset": offsets,
    }


def text_offsets(tokens: List[str], offset: int) -> List[int]:
    """Where each token's text starts, the first at `offset`."""
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return offsets


def completion_logprobs(outputs: List[Output], tokenizer: Tokenizer, offset: int) -> dict:
    """Completions' legacy "logprobs": tokens, token_logprobs, top_logprobs and text_offset, from `offset`."""
    tokens = [tokenizer.decode([o.token]) for o in outputs]
    return {
        "tokens": tokens,
        "token_logprobs": [o.logprob for o in outputs],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in o.top_logprobs or []} for o in outputs],
        "text_offset": text_offsets(tokens, offset),
    }
