"""What generation tells a person who waits: a notice while a compiled step compiles, and the speed of an answer
(what a load tells them is `llama.checkpoint.report`'s).

Nothing here prints to stdout. Notices go through the `llama.progress` logger (the `llama` command and the example
scripts show its INFO records on stderr; a program using the library sees them only if it asks, through `logging`).
"""

import time
from dataclasses import dataclass

from llama.runtime.compiled import compile_seconds


@dataclass
class Speed:
    """New tokens generated and the seconds that took, compiling left out, and the prompt tokens whose keys and
    values were already cached (all rows together)."""

    tokens: int
    seconds: float
    reused: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        reused = f", {self.reused} prompt tokens reused" if self.reused else ""
        return f"[{self.tokens} tokens in {self.seconds:.1f} s, {self.tokens_per_second:.1f} tokens/s{reused}]"


class Stopwatch:
    """Times a generation through `decoder` (a `BatchDecoder`), leaving out what its decode step spends compiling."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.start = time.perf_counter()
        self.compiled_before = compile_seconds(decoder.decode_step)

    def speed(self, tokens: int) -> Speed:
        compiling = compile_seconds(self.decoder.decode_step) - self.compiled_before
        return Speed(tokens, time.perf_counter() - self.start - compiling, sum(self.decoder.last_reused))
