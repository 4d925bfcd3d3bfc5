"""Speculative decoding: a cheap proposer guesses the next tokens, and the model checks them all in one forward
pass, which reads its weights once. Each guess the model agrees with is a token without a step of its own.

- `PromptLookup` proposes by prompt lookup: where the sequence's last few tokens also appear earlier (in the prompt
  or the answer so far), the tokens that followed them there.
- `DraftModel` proposes what a smaller (or quantized) model with the same tokenizer decodes greedily next.
- `accept_greedy` keeps the tokens the model picks itself: the guesses up to the first it disagrees with, then the
  model's own token there. The answer is plain greedy decoding's.
- `accept_sampled` keeps the distribution of the model's samples (Leviathan et al. 2023; Chen et al. 2023): a
  guessed token d is kept with probability p(d), and where one is refused the token is drawn from p with d taken
  out. The proposer here is deterministic (it proposes d with certainty), for which that is the whole rule.
- `DraftLength` sets how many tokens to propose, and backs off while guesses fail, so that a text the proposer
  cannot guess costs little more than plain decoding.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from llama.arguments import LOOKUP
from llama.decoding.sampling import greedy_pick
from llama.runtime import RuntimeTransformer

# The n-gram lengths prompt lookup matches, longest first: a longer match is more likely to go on alike.
LOOKUP_NGRAMS = (3, 2, 1)


class PromptLookup:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens (n from
    `LOOKUP_NGRAMS`, longest first). Each n-gram's latest position is indexed as tokens arrive, so that a proposal
    costs the same however long the sequence grows."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: List[int] = []
        self.latest: Dict[Tuple[int, ...], int] = {}  # n-gram -> the position of the token that followed it
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here are followed by `token`
            for n in LOOKUP_NGRAMS:
                if end >= n:
                    self.latest[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def propose(self, count: int) -> List[int]:
        """Up to `count` tokens that may come next; none where no n-gram of the sequence's end appeared before."""
        if count < 1:
            return []
        for n in LOOKUP_NGRAMS:
            if len(self.tokens) < n:
                continue
            follows = self.latest.get(tuple(self.tokens[-n:]))
            if follows is not None:
                return self.tokens[follows : follows + count]
        return []


class DraftModel:
    """Proposes the tokens `model` (a draft: a smaller model with the same tokenizer, or a quantized copy) picks
    greedily after the sequence, one step each, in its own KV cache's row 0. What its cache already holds of the
    sequence (`model.cached`) is not run again, so after refused guesses it runs from the first refused position,
    and after kept ones from where it stopped."""

    def __init__(self, model: RuntimeTransformer, tokens: Sequence[int] = ()):
        self.model = model
        self.tokens: List[int] = list(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(token) for token in tokens)

    def propose(self, count: int) -> List[int]:
        if count < 1:
            return []
        device = self.model.tok_embeddings.weight.device
        start = self.model.cached.reusable(0, self.tokens)
        run = torch.tensor([self.tokens[start:]], dtype=torch.long, device=device)
        guesses: List[int] = []
        while True:
            logits = self.model.forward(run, start, last_logits_only=True)
            guesses.append(int(greedy_pick(logits[0, -1:])[0]))
            if len(guesses) == count:
                return guesses
            start += run.shape[1]
            run = torch.tensor([guesses[-1:]], dtype=torch.long, device=device)


Proposer = Union[PromptLookup, DraftModel]


def proposer_for(draft: Union[str, RuntimeTransformer], tokens: Sequence[int]) -> Proposer:
    """The proposer of a `BatchDecoder`'s `draft` ("lookup", or a draft model), starting from `tokens`."""
    return PromptLookup(tokens) if draft == LOOKUP else DraftModel(draft, tokens)


def accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> Tuple[int, int]:
    """`logits` (len(draft) + 1, vocab): the model's after the last accepted token and after each guessed one.
    Returns how many guesses the model's greedy picks agree with, and its own token after them."""
    picks = greedy_pick(logits.float()).tolist()
    accepted = 0
    while accepted < len(draft) and picks[accepted] == draft[accepted]:
        accepted += 1
    return accepted, picks[accepted]


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution `sample_top_p` draws from, over the whole vocabulary, for each row of `logits`: softmax at
    `temperature`, the smallest set of most likely tokens holding more than `top_p` of the mass, renormalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ranked, vocab_index = torch.sort(probs, dim=-1, descending=True)
    kept = torch.where(torch.cumsum(ranked, dim=-1) - ranked > top_p, 0.0, ranked)
    return torch.zeros_like(probs).scatter_(-1, vocab_index, kept / kept.sum(dim=-1, keepdim=True))


def accept_sampled(
    logits: torch.Tensor,
    draft: Sequence[int],
    temperature: float,
    top_p: float,
    generator: Optional[torch.Generator] = None,
) -> Tuple[int, int]:
    """`accept_greedy` for sampling at `temperature` and `top_p`: each guess d in turn is kept with probability
    p(d) under the model's distribution p there; at the first refused one, the token is drawn from p with d taken
    out; after every guess is kept, from the next p. Each token is then distributed as the model's own sample.
    The draws come from `generator` (default: torch's global one), so a seeded run repeats. A temperature so small
    that the softmax overflows gives the greedy tokens, its limit, as `sample_next` does."""
    dists = nucleus(logits, temperature, top_p)
    if bool(torch.isnan(dists).any()):
        return accept_greedy(logits, draft)
    for i, guess in enumerate(draft):
        if float(torch.rand((), generator=generator)) < float(dists[i, guess]):
            continue
        rest = dists[i].clone()
        rest[guess] = 0.0
        return i, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(dists[len(draft)], 1, generator=generator))


class DraftLength:
    """How many tokens to propose at each step: up to `draft_max`, growing while guesses are kept and shrinking
    where they are not; after a step that kept none, no proposal for a while (1, 2, 4, ... up to `MAX_PAUSE`
    steps, reset by a kept guess), so that a text the proposer cannot guess runs almost as plain decoding does."""

    MAX_PAUSE = 32

    def __init__(self, draft_max: int):
        self.draft_max = draft_max
        self.length = draft_max
        self.misses = 0  # verification passes in a row that kept no guess
        self.pause = 0  # steps left without a proposal

    def next(self) -> int:
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.length

    def update(self, proposed: int, accepted: int) -> None:
        if accepted == proposed:
            self.length = min(self.draft_max, self.length * 2)
        else:
            self.length = max(1, accepted + 1)
        if accepted == 0:
            self.pause = min(2**self.misses, self.MAX_PAUSE)
            self.misses += 1
        else:
            self.misses = 0


@dataclass
class DraftCounts:
    """What speculation did in one generation: tokens proposed, proposed tokens kept, and model passes (a
    verification, or a plain step) after the prompt's."""

    proposed: int = 0
    accepted: int = 0
    passes: int = 0
