"""The streaming forms of `Llama.text_completion` and `Llama.chat_completion`: each answer's new text as soon as it
can be decoded. `Llama` has them from `StreamingCompletions`."""

from typing import Dict, Iterator, List, Optional

import torch

from llama.checks import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.completions import encode_dialogs, encode_prompts
from llama.decoding import BatchDecoder, StreamChunk
from llama.tokenizer import ChatFormat, Dialog, Tokenizer


class StreamingCompletions:
    """`text_completion_stream` and `chat_completion_stream`, for `Llama`: they encode with its tokenizer and chat
    format and decode with its decoder."""

    tokenizer: Tokenizer
    formatter: ChatFormat
    decoder: BatchDecoder

    @torch.inference_mode()
    def text_completion_stream(
        self,
        prompts: List[str],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Like `text_completion`, but yields each prompt's new text as soon as it can be decoded.

        Chunks of different prompts interleave; join the `text` of one `index` to get its whole generation,
        which equals `text_completion`'s for the same seed. A chunk never ends inside a multi-byte character.
        Each prompt's last chunk has `finished=True` and its `stop_reason`.

        Raises:
            ValueError: as `text_completion`.
        """
        prompt_tokens = encode_prompts(self.tokenizer, prompts)
        yield from self.decoder.stream(prompt_tokens, self.decoder.gen_len(max_gen_len), temperature, top_p)

    @torch.inference_mode()
    def chat_completion_stream(
        self,
        dialogs: List[Dialog],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Like `chat_completion`, but yields each answer's new text as soon as it can be decoded.

        See `text_completion_stream` for the chunks; joined, they are the answer's text (`chat_completion`'s
        content unless it calls tools), and with Llama 3.1+ the last one carries the answer's `tool_calls`, if any.

        Raises:
            ValueError: as `chat_completion`.
        """
        prompt_tokens = encode_dialogs(self.formatter, dialogs)
        chunks = self.decoder.stream(prompt_tokens, self.decoder.gen_len(max_gen_len), temperature, top_p)
        yield from with_tool_calls(self.formatter, chunks)


def with_tool_calls(formatter: ChatFormat, chunks: Iterator[StreamChunk]) -> Iterator[StreamChunk]:
    """`chunks` as they come; with Llama 3.1+ tokens, each answer's last chunk carries the tool calls its whole text
    makes (as `assistant_message` reads them), or None."""
    if formatter.tokenizer.version == "3":
        yield from chunks
        return
    texts: Dict[int, List[str]] = {}
    for chunk in chunks:
        texts.setdefault(chunk.index, []).append(chunk.text)
        if chunk.finished:
            text = "".join(texts.pop(chunk.index))
            message = formatter.decode_assistant_message_from_content(text, chunk.stop_reason or "length")
            chunk.tool_calls = message["tool_calls"] or None
        yield chunk
