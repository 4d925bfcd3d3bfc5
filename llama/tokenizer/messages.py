"""The shapes of chat messages and tool calls, as `ChatFormat` writes and reads them."""

from collections.abc import Sequence
from typing import Any, Literal, TypedDict, Union, get_args

# "tool" is another name for "ipython" (a tool's output): both are written as ipython, as llama-models does.
Role = Literal["system", "user", "assistant", "ipython", "tool"]
# The roles a dialog may use, by tokenizer version: a tool's output arrived with Llama 3.1.
ROLES: dict[str, tuple[Role, ...]] = {"3": ("system", "user", "assistant"), "3.1": get_args(Role)}

# Why an answer ended: <|eot_id|>, <|eom_id|> (Llama 3.1+: a tool call awaits its result), or max_gen_len.
StopReason = Literal["end_of_turn", "end_of_message", "length"]
STOP_REASONS: tuple[StopReason, ...] = get_args(StopReason)
# The special tokens that end a message in the chat format, with the stop reason each stands for.
STOP_TOKEN_REASONS: dict[str, StopReason] = {"<|eot_id|>": "end_of_turn", "<|eom_id|>": "end_of_message"}


class _ToolCallFields(TypedDict):
    tool_name: str  # a built-in tool (BUILTIN_TOOLS) or a function's name
    arguments: dict[str, Any]


class ToolCall(_ToolCallFields, total=False):
    """A tool call made by the assistant (Llama 3.1 and later)."""

    call_id: str  # set on calls read from the model's output; never written into the prompt


class _MessageFields(TypedDict):
    role: Role
    content: Union[str, list[dict[str, Any]]]  # a str, or text and image parts (`llama.tokenizer.content`)


class Message(_MessageFields, total=False):
    """A chat message. Assistant messages of Llama 3.1 and later may also carry tool calls."""

    tool_calls: list[ToolCall]  # written after the content, each call in the chat format
    stop_reason: StopReason  # "end_of_message" ends the message with <|eom_id|> instead of <|eot_id|>


Dialog = Sequence[Message]
