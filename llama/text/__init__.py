"""Text and token IDs, in one place for the library, the command line and the server: text into prompts
(`prompts`), tokens back into the reference's answers (`answers`, which also reads tool calls out of generated text,
once) and into text as tokens arrive (`stream`: UTF-8 decoded incrementally, once)."""

from llama.text.answers import assistant_message, chat_prediction, completion_prediction, tool_call_message
from llama.text.prompts import dialog_images, encode_dialogs, encode_prompts, prompt_images
from llama.text.stream import AnswerText, StreamChunk, stream_chunks, with_tool_calls

__all__ = [
    "AnswerText",
    "StreamChunk",
    "assistant_message",
    "chat_prediction",
    "completion_prediction",
    "dialog_images",
    "encode_dialogs",
    "encode_prompts",
    "prompt_images",
    "stream_chunks",
    "tool_call_message",
    "with_tool_calls",
]
