"""What generation tells a person who waits: a notice while a compiled step compiles, and the speed of an answer
(what a load tells them is `llama.checkpoint.report`'s).

Nothing here prints to stdout. Notices go through the `llama.progress` logger (the `llama` command and the example
scripts show its INFO records on stderr; a program using the library sees them only if it asks, through `logging`).
"""

import time
from dataclasses import dataclass, field

from llama.decoding.speculative import DraftCounts
from llama.runtime.compiled import compile_seconds


@dataclass
class Speed:
    """New tokens generated and the seconds that took, compiling left out, and the prompt tokens whose keys and
    values were already cached (all rows together); decoding speculatively, the guessed tokens, those of them
    kept, and the model's passes after the prompt's (`llama.decoding.speculative.DraftCounts`)."""

    tokens: int
    seconds: float
    reused: int = 0
    drafts: DraftCounts = field(default_factory=DraftCounts)

    @property
    def acceptance_rate(self) -> float:
        """The share of guessed tokens the model kept (0 where none was guessed)."""
        return self.drafts.accepted / max(self.drafts.proposed, 1)

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per pass of the model, the prompt's included (1 decoding a token a step)."""
        return self.tokens / (self.drafts.passes + 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        reused = f", {self.reused} prompt tokens reused" if self.reused else ""
        drafts = ""
        if self.drafts.proposed:
            kept = f"{self.drafts.accepted} of {self.drafts.proposed} guessed tokens kept ({self.acceptance_rate:.0%})"
            drafts = f", {kept}, {self.tokens_per_pass:.2f} tokens a pass"
        return f"[{self.tokens} tokens in {self.seconds:.1f} s, {self.tokens_per_second:.1f} tokens/s{reused}{drafts}]"


class Stopwatch:
    """Times a generation through `decoder` (a `BatchDecoder`), leaving out what its decode step spends compiling."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.start = time.perf_counter()
        self.compiled_before = compile_seconds(decoder.decode_step)

    def speed(self, tokens: int) -> Speed:
        compiling = compile_seconds(self.decoder.decode_step) - self.compiled_before
        seconds = time.perf_counter() - self.start - compiling
        return Speed(tokens, seconds, sum(self.decoder.last_reused), self.decoder.last_drafts)
