"""llama: Meta's Llama 3 inference API (`Llama.build`, `text_completion`, `chat_completion`), reimplemented.

The names below are imported when first used (PEP 562), so that `import llama` is instant and the `llama` command
answers `--version` and `-h`, or a Ctrl-C, before torch has loaded. `from llama import Llama` works as ever.
"""

import importlib

__version__ = "0.1.0"  # the one place it is written: setup.py reads it from here

# name -> the module of the package that defines it
_EXPORTS = {
    "ChatFormat": "tokenizer",
    "ChatPrediction": "generation",
    "CompletionPrediction": "generation",
    "Dialog": "tokenizer",
    "Llama": "generation",
    "Message": "tokenizer",
    "ModelArgs": "model",
    "Role": "tokenizer",
    "StopReason": "tokenizer",
    "StreamChunk": "text",
    "Tokenizer": "tokenizer",
    "ToolCall": "tokenizer",
    "Transformer": "model",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llama' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"llama.{_EXPORTS[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
