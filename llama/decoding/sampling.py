"""Choosing each next token from the model's logits: Meta's nucleus sampling (`sample_top_p`) first, then the CPU's
shortcut to its draws (`nucleus_head`, `token_ranked`), then what a decoder calls (`sample_next`, `greedy_pick`)."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def sample_top_p(probs: torch.Tensor, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Nucleus sampling: draw from the smallest set of most likely tokens whose probabilities add up to more than
    `p`, renormalised.

    A token is kept when the tokens ranked above it hold at most `p` of the mass, so the most likely one always is.
    One `torch.multinomial` draw per row, from `generator` or else the global one: seeded runs give the same tokens.

    Args:
        probs: Probability distributions, (bsz, vocab_size).
        p: Probability mass to keep.
        generator: Where the draws come from; None: torch's global generator.

    Returns:
        The sampled token indices, (bsz, 1).
    """
    head = nucleus_head(probs, p) if probs.device.type == "cpu" else None
    ranked, vocab_index = head if head is not None else torch.sort(probs, dim=-1, descending=True)
    # On CPU a cumulative sum adds in order, so over the head it gives the sorted row's first sums bit for bit.
    mass_above = torch.cumsum(ranked, dim=-1) - ranked
    nucleus = torch.where(mass_above > p, 0.0, ranked)
    if head is not None:  # the rest of each row ranks below mass p: zeros, as in the fully sorted row
        nucleus = F.pad(nucleus, (0, probs.shape[-1] - nucleus.shape[-1]))
    nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
    drawn = torch.multinomial(nucleus, num_samples=1, generator=generator)
    if head is None:
        return vocab_index.gather(-1, drawn)
    rows = range(len(probs))
    return torch.stack([token_ranked(probs[row], ranked[row], vocab_index[row], int(drawn[row])) for row in rows])


# The rows' most likely tokens `nucleus_head` ranks first; more where they hold too little of the mass.
NUCLEUS_HEAD_SIZES = (64, 2048)


def nucleus_head(probs: torch.Tensor, p: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The first columns of `torch.sort(probs, descending=True)` for each row, down past where the mass above a
    token exceeds `p` in every row (so the rest of the row lies outside the nucleus), or None where the largest
    head holds too little of the mass (a flat distribution, or `p` near 1).

    On CPU, sorting the 128256 probabilities of Llama 3's vocabulary takes milliseconds, more than a decode step of
    a small model; `torch.topk` ranks the head in a fraction of that. The values are the sort's, in its order; among
    equal values the indices may come in another order, which `token_ranked` settles.
    """
    if not bool(probs.amin() >= 0):
        return None  # not probabilities: the full sort, and multinomial's error
    for size in NUCLEUS_HEAD_SIZES:
        if size >= probs.shape[-1]:
            return None
        ranked, vocab_index = torch.topk(probs, size, dim=-1)
        # Past the head the cumulative sum only grows, so the mass above any later token is at least the head's
        # (up to the rounding of one subtraction, some 1e-7).
        head_mass = torch.cumsum(ranked, dim=-1)[:, -1]
        if bool((head_mass - p > 1e-6).all()):
            return ranked, vocab_index
        # No later token is more likely than the head's last, so a row needs at least `short` more tokens; on
        # real models' rows the nucleus runs several times longer than that bound (docs/speed.md). Rows that the
        # largest head would not hold either go to the full sort now.
        short = (p - head_mass) / ranked[:, -1]
        if bool((short > NUCLEUS_HEAD_SIZES[-1] / 8).any()):
            return None
    return None


def token_ranked(probs: torch.Tensor, ranked: torch.Tensor, vocab_index: torch.Tensor, rank: int) -> torch.Tensor:
    """The token at `rank` in `torch.sort(probs, descending=True)` of one row, from the row's `nucleus_head`.

    A probability that no other token has names its token. Tokens of equal probability sit next to each other in
    the ranking, and which of them the full sort (an unstable one) puts at which rank is its own: for those, and
    at the head's last rank, whose neighbour below is not in the head, the row is sorted to find out.
    """
    neighbour_below_in_head = rank + 1 < len(ranked)
    if neighbour_below_in_head and ranked[rank] != ranked[rank + 1] and (rank == 0 or ranked[rank] != ranked[rank - 1]):
        return vocab_index[rank : rank + 1]
    return torch.sort(probs, descending=True).indices[rank : rank + 1]


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Each row's next token from its logits (bsz, vocab_size): `greedy_pick` at temperature 0, else a draw of
    `sample_top_p` from softmax(logits / temperature), as Meta's reference does, from `generator` (default: the
    global one). Returns (bsz, 1).

    As the temperature goes to 0 the distribution narrows to the greedy token. A temperature so small that
    logits / temperature overflows float32 (1e-300 does for any logit) leaves the softmax nothing but NaN, a
    distribution no draw can come from; such a row takes its greedy token, the limit, instead of a torch error.
    """
    if temperature == 0:
        return greedy_pick(logits).reshape(-1, 1)
    probs = torch.softmax(logits / float(temperature), dim=-1)
    drawable = ~torch.isnan(probs).any(dim=-1)
    if bool(drawable.all()):
        return sample_top_p(probs, float(top_p), generator)
    next_token = greedy_pick(logits).reshape(-1, 1)
    if bool(drawable.any()):
        next_token[drawable] = sample_top_p(probs[drawable], float(top_p), generator)
    return next_token


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1)`: the first of equal maxima, or the first NaN. On CPU it runs through numpy,
    whose argmax is vectorised where torch's is a scalar loop over the vocabulary (docs/speed.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return torch.argmax(logits, dim=-1)
