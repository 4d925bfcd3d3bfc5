"""OpenAI's answer shapes for `llama.serve`: an answer's text as its tokens arrive (stop strings, whole UTF-8
characters), its logprobs (chat's and the completions' legacy form, a scored prompt's included) and the tool calls it
makes. No HTTP here; the requests' shapes are `llama.openai_api`'s.
"""

import codecs
import json
from typing import List, Optional

from llama.engine import Output
from llama.tokenizer import ChatFormat, Tokenizer


def tool_calls_out(text: str, stop_reason: str, formatter: ChatFormat) -> Optional[List[dict]]:
    """The calls an answer makes, in OpenAI's shape, or None (Llama 3 tokens, or plain text)."""
    if formatter.tokenizer.version == "3":
        return None
    calls = formatter.decode_assistant_message_from_content(text, stop_reason)["tool_calls"]
    return [
        {
            "id": call["call_id"],
            "type": "function",
            "function": {"name": call["tool_name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in calls
    ] or None


class AnswerText:
    """An answer's text as its tokens arrive: whole UTF-8 characters only, cut at the first stop string.

    Text that could be the start of a stop string (the last len(longest stop) - 1 characters) is held back until
    the next token settles it. A stop string that ends in a token's text begins in that text or in the held-back
    part, so each token's search covers only those two: linear in the answer's length.
    """

    def __init__(self, tokenizer: Tokenizer, stops: List[str]):
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
