"""A compiled decode step as a person meets it: a notice through the `llama.progress` logger before each batch
size's first call, when torch.compile compiles it, and the seconds compiling took, which a speed leaves out."""

import logging
import time
from typing import Callable

import torch

logger = logging.getLogger("llama.progress")


class AnnouncedCompiles:
    """A compiled decode step that says, before each batch size's first call (when torch.compile compiles it),
    that it is compiling, and keeps the seconds those calls took (`compile_seconds`), so that a speed can leave
    them out."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.step = step
        self.compiled_batch_sizes = set()
        self.compile_seconds = 0.0

    def __call__(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        bsz = tokens.shape[0]
        if bsz in self.compiled_batch_sizes:
            return self.step(tokens, position)
        logger.info("Compiling the decode step for batch size %d (once per batch size; can take a minute)...", bsz)
        start = time.perf_counter()
        logits = self.step(tokens, position)
        seconds = time.perf_counter() - start
        self.compiled_batch_sizes.add(bsz)
        self.compile_seconds += seconds
        logger.info("Compiled the decode step for batch size %d in %.1f s", bsz, seconds)
        return logits


def is_compiled(step) -> bool:
    """Whether `step` (a decoder's decode step, or None) is a compiled one."""
    return isinstance(step, AnnouncedCompiles)


def compile_seconds(step) -> float:
    """Seconds `step` (a decoder's decode step, or None) has spent compiling so far."""
    return getattr(step, "compile_seconds", 0.0)
