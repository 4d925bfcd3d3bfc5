"""What each row of the KV cache holds: the tokens whose keys and values sit at its positions 0, 1, ... in order.

A prompt that begins with a row's tokens needs only the rest run through the model (prefix reuse, docs/chat.md and
docs/serve.md). The keys and values at a position depend on every token before it, so a row holds a prefix: a write
at position p makes the row's record the tokens before p followed by those written, and anything past them is gone.
Every write of the cache is recorded (`RuntimeTransformer.forward` records its own; the callers of the fixed-shape
decode step, which may be compiled or replayed as a CUDA graph, record theirs), so the record never claims what the
cache does not hold.
"""

from typing import List, Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class CachedTokens:
    """The tokens each of `rows` rows of a KV cache holds (see the module)."""

    def __init__(self, rows: int):
        self.rows: List[List[int]] = [[] for _ in range(rows)]

    def __getitem__(self, row: int) -> List[int]:
        return self.rows[row]

    def wrote(self, row: int, start: int, tokens: Sequence[int]) -> None:
        """Row `row` now holds the keys and values of `tokens` at positions start, start + 1, ..."""
        held = self.rows[row]
        if start <= len(held):
            held[start:] = tokens
        # else: written past positions the row does not hold; those before still stand, nothing after them does.

    def keep(self, row: int, length: int) -> None:
        """Row `row` holds no more than its first `length` tokens: the positions after are being overwritten."""
        del self.rows[row][length:]

    def reusable(self, row: int, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s first tokens row `row` already holds, short of the last one: the model must run
        at least the last to give the logits of the next."""
        return min(common_prefix_length(self.rows[row], prompt), len(prompt) - 1)

    def forget(self) -> None:
        for held in self.rows:
            held.clear()
