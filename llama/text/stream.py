"""Tokens back into text as they arrive: an answer's text in whole UTF-8 characters, cut at stop strings
(`AnswerText`, for the library's streams and the server's answers), and the library's stream chunks made of a
decoder's new tokens (`stream_chunks`), the last one of a chat answer carrying its tool calls (`with_tool_calls`)."""

import codecs
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from llama.decoding import NewTokens
from llama.text.answers import tool_call_message
from llama.tokenizer import ChatFormat, StopReason, Tokenizer, ToolCall


@dataclass
class StreamChunk:
    """New text for one prompt of a streaming call."""

    index: int  # which prompt or dialog of the batch
    text: str  # decoded text since this prompt's previous chunk
    finished: bool = False  # this prompt's last chunk
    stop_reason: Optional[StopReason] = None  # set on the last chunk
    n_tokens: int = 0  # tokens generated for this prompt so far
    tool_calls: Optional[List[ToolCall]] = None  # on a Llama 3.1+ chat answer's last chunk, if it called tools


class AnswerText:
    """An answer's text as its tokens arrive: whole UTF-8 characters only, cut at the first stop string.

    Text that could be the start of a stop string (the last len(longest stop) - 1 characters) is held back until
    the next token settles it. A stop string that ends in a token's text begins in that text or in the held-back
    part, so each token's search covers only those two: linear in the answer's length.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.held = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Take a token; return the text now safe to send."""
        return self.settle(self.held + self.decoder.decode(self.tokenizer.decode_bytes([token])), final=False)

    def flush(self) -> str:
        """The rest of the text, at the end."""
        return "" if self.stopped else self.settle(self.held + self.decoder.decode(b"", final=True), final=True)

    def settle(self, text: str, final: bool) -> str:
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.held, self.stopped = "", True
            return text[: min(found)]
        cut = len(text) if final else max(0, len(text) - self.keep)
        self.held = text[cut:]
        return text[:cut]

    def add_tokens(self, tokens: Iterable[int]) -> str:
        """Take several tokens; return the text now safe to send."""
        return "".join(self.add(token) for token in tokens)


def stream_chunks(tokenizer: Tokenizer, events: Iterator[NewTokens]) -> Iterator[StreamChunk]:
    """A `StreamChunk` for each of a decoder's `NewTokens` that completes some text, and for each row's last: its
    text is what the row's tokens so far decode to past its previous chunk, never ending inside a character."""
    texts: Dict[int, AnswerText] = {}
    counts: Dict[int, int] = {}
    for event in events:
        answer = texts.setdefault(event.index, AnswerText(tokenizer))
        counts[event.index] = counts.get(event.index, 0) + len(event.tokens)
        finished = event.stop_reason is not None
        text = answer.add_tokens(event.tokens) + (answer.flush() if finished else "")
        if text or finished:
            yield StreamChunk(event.index, text, finished, event.stop_reason, n_tokens=counts[event.index])


def with_tool_calls(formatter: ChatFormat, chunks: Iterator[StreamChunk]) -> Iterator[StreamChunk]:
    """`chunks` as they come; each answer's last chunk carries the tool calls its whole text makes
    (`tool_call_message`), or None."""
    texts: Dict[int, List[str]] = {}
    for chunk in chunks:
        texts.setdefault(chunk.index, []).append(chunk.text)
        if chunk.finished:
            text = "".join(texts.pop(chunk.index))
            message = tool_call_message(formatter, text, chunk.stop_reason or "length")
            chunk.tool_calls = message["tool_calls"] if message else None
        yield chunk
