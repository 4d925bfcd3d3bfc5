"""Text to token IDs and back, one concern a module: `bpe` (the `Tokenizer`: tokenizer.model's ranks run by
tiktoken, the special tokens), `messages` (the shapes of messages and tool calls), `chat_format` (`ChatFormat`:
dialogs written as tokens, answers read back), `tool_calls` (tool calls as text, written and parsed) and `files`
(reading a local path or a blobfile URL)."""

from llama.tokenizer.bpe import SUPPORTED_VERSIONS, Tokenizer, load_bpe_ranks
from llama.tokenizer.chat_format import ChatFormat, stop_reason
from llama.tokenizer.messages import (
    ROLES,
    STOP_REASONS,
    STOP_TOKEN_REASONS,
    Dialog,
    Message,
    Role,
    StopReason,
    ToolCall,
)
from llama.tokenizer.tool_calls import (
    BUILTIN_TOOLS,
    TOOL_PROMPT_FORMATS,
    check_tool_call,
    encode_tool_call,
    parse_tool_calls,
)

__all__ = [
    "BUILTIN_TOOLS",
    "ChatFormat",
    "Dialog",
    "Message",
    "ROLES",
    "Role",
    "STOP_REASONS",
    "STOP_TOKEN_REASONS",
    "SUPPORTED_VERSIONS",
    "StopReason",
    "TOOL_PROMPT_FORMATS",
    "Tokenizer",
    "ToolCall",
    "check_tool_call",
    "encode_tool_call",
    "load_bpe_ranks",
    "parse_tool_calls",
    "stop_reason",
]
