"""llama: Meta's Llama 3 inference API (`Llama.build`, `text_completion`, `chat_completion`), reimplemented."""

from .decoding import StopReason, StreamChunk
from .generation import ChatPrediction, CompletionPrediction, Llama
from .model import ModelArgs, Transformer
from .tokenizer import ChatFormat, Dialog, Message, Role, Tokenizer, ToolCall

__all__ = [
    "ChatFormat",
    "ChatPrediction",
    "CompletionPrediction",
    "Dialog",
    "Llama",
    "Message",
    "ModelArgs",
    "Role",
    "StopReason",
    "StreamChunk",
    "Tokenizer",
    "ToolCall",
    "Transformer",
]
