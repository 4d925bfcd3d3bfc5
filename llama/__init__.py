"""llama: Meta's Llama 3 inference API (`Llama.build`, `text_completion`, `chat_completion`), reimplemented."""

__version__ = "0.1.0"  # the one place it is written: setup.py reads it from here

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
    "__version__",
]
