"""Speculative decoding in the server's engine (`llama.serve.engine`), with the proposers and acceptance rules of
`llama.decoding.speculative`.

A request decodes speculatively while it runs alone: it is the only row in use, nothing waits, and it asks for no
logprobs and no grammar. Each such step runs the row's last token and its proposer's guesses in one pass of the
model over the row, and the request gets the guesses the model agrees with and the model's own token after them.
As soon as another request arrives, the step is a plain decode step over every row again: under load, continuous
batching already reads the weights once for many tokens, and a pass over one row's guesses would hold the others
back.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from llama.arguments import LOOKUP
from llama.decoding.speculative import (
    DraftCounts,
    DraftLength,
    Proposer,
    accept_greedy,
    accept_sampled,
    proposer_for,
)
from llama.runtime import RuntimeTransformer


@dataclass
class Guesser:
    """One request's proposer, fed the prompt and every token the request is given, and its draft length."""

    proposer: Proposer
    length: DraftLength


class Speculation:
    """The engine's speculation with `draft` ("lookup", or a draft model: `Llama.build`'s `draft`), up to
    `draft_max` guesses a pass, and what it did since the start (`counts`).

    Raises:
        ValueError: for a draft model where the engine's steps run in several processes (`distributed`): rank 0
            alone proposes, and a draft model would have to run in every process.
    """

    def __init__(self, draft: Union[str, RuntimeTransformer], draft_max: int, distributed: bool):
        if distributed and draft != LOOKUP:
            raise ValueError(
                f"Under torchrun the server speculates by prompt lookup only: use --draft {LOOKUP} or no --draft"
            )
        self.draft, self.draft_max = draft, draft_max
        self.counts = DraftCounts()

    def guesser_for(self, prompt: List[int], logprobs: bool, grammar: bool) -> Optional[Guesser]:
        """A request's `Guesser`; None for one that asks for logprobs or a grammar (it decodes a token a step)."""
        if logprobs or grammar:
            return None
        return Guesser(proposer_for(self.draft, prompt), DraftLength(self.draft_max))

    @staticmethod
    def guesses(guesser: Guesser, room: int) -> List[int]:
        """The next guesses, as many as the guesser's draft length allows and at most `room`."""
        return guesser.proposer.propose(min(guesser.length.next(), room))

    def accept(
        self,
        guesser: Guesser,
        guesses: List[int],
        logits: torch.Tensor,
        temperature: float,
        top_p: float,
        generator: torch.Generator,
    ) -> List[int]:
        """The tokens a pass gives: the guesses the model agrees with and its own token after them (`accept_greedy`,
        or `accept_sampled` drawing from the request's `generator`). `logits` are the pass's, one row per position."""
        if temperature == 0:
            accepted, token = accept_greedy(logits, guesses)
        else:
            accepted, token = accept_sampled(logits, guesses, temperature, top_p, generator)
        guesser.length.update(len(guesses), accepted)
        self.counts.proposed += len(guesses)
        self.counts.accepted += accepted
        self.counts.passes += 1
        return guesses[:accepted] + [token]

    def report(self) -> dict:
        """What speculation did since the start, for /health: guesses proposed and kept, verification passes, and
        the tokens each pass gave (the kept guesses and the model's own token after them)."""
        counts = self.counts
        return {
            "proposed_tokens": counts.proposed,
            "accepted_tokens": counts.accepted,
            "acceptance_rate": round(counts.accepted / max(counts.proposed, 1), 4),
            "verification_passes": counts.passes,
            "tokens_per_pass": round((counts.accepted + counts.passes) / max(counts.passes, 1), 4),
        }
