# Copyright (c) Meta Platforms, Inc. and affiliates.
# This software may be used and distributed in accordance with the terms of the Llama 3 Community License Agreement.

from .generation import ChatPrediction, CompletionPrediction, Llama
from .model import ModelArgs, Transformer
from .tokenizer import ChatFormat, Dialog, Message, Role, Tokenizer

__all__ = [
    "ChatFormat",
    "ChatPrediction",
    "CompletionPrediction",
    "Dialog",
    "Llama",
    "Message",
    "ModelArgs",
    "Role",
    "Tokenizer",
    "Transformer",
]
