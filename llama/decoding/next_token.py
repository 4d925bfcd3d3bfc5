"""What both decoders do with the logits of a step: the library's `BatchDecoder` (`llama.decoding.batch`), which
keeps the reference's batch semantics, and the server's `Engine` (`llama.serve.engine`), which batches continuously
(docs/internals.md says why there are two). Each masks the logits of the rows that decode under a grammar
(`masked_to_grammars`), draws the next token (`llama.decoding.sampling.sample_next`), feeds it to the grammars
(`advance_grammars`), stops an answer at its first stop token (`cut_at_stop`) and scores tokens (`token_logprobs`,
`scores`)."""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from llama.decoding.grammar import Constraint
from llama.tokenizer import StopReason, Tokenizer, stop_reason


def masked_to_grammars(logits: torch.Tensor, rows: Sequence[Tuple[int, Constraint]]) -> torch.Tensor:
    """The next-token logits (bsz, vocab_size), each of `rows`' (row, constraint) masked to what its grammar allows."""
    if not rows:
        return logits
    logits = logits.clone()
    for row, constraint in rows:
        logits[row] = constraint.mask(logits[row])
    return logits


def advance_grammars(rows: Sequence[Tuple[int, Constraint]], tokens: torch.Tensor) -> None:
    """Feed each of `rows`' grammars the token its row drew (`tokens`, one per row of the batch)."""
    for row, constraint in rows:
        constraint.advance(int(tokens[row]))


def cut_at_stop(tokenizer: Tokenizer, tokens: List[int]) -> Tuple[List[int], Optional[StopReason]]:
    """`tokens` up to the first stop token, and which kind of stop it was (None: no stop token)."""
    stop_at = [tokens.index(stop) for stop in tokenizer.stop_tokens if stop in tokens]
    if not stop_at:
        return tokens, None
    first = min(stop_at)
    return tokens[:first], stop_reason(tokenizer, tokens[first])


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Each target token's log-probability under the logits of its position: `logits` (bsz, positions, vocab_size),
    `targets` (bsz, positions); a `pad_id` target scores 0."""
    return -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=pad_id)


def scores(logits: torch.Tensor, targets: List[int], top: int) -> List[Tuple[float, List[Tuple[int, float]]]]:
    """Each target token's logprob under the logits of the position before it, with the `top` likeliest tokens and
    theirs: `logits` (positions, vocab_size), one position per target (the last position may have none)."""
    logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    rows = torch.arange(len(targets), device=logits.device)
    chosen = logprobs[rows, torch.tensor(targets, dtype=torch.long, device=logits.device)].tolist()
    values, tokens = torch.topk(logprobs, top) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [(lp, list(zip(t, v))) for lp, t, v in zip(chosen, tokens.tolist(), values.tolist())]
