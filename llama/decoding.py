"""Batch decoding: from token-ID prompts to generated tokens, for a model, a tokenizer and a one-token step.

`BatchDecoder` lays the prompts out in one right-padded table, runs the model over the positions from the
shortest prompt's end, samples each next token, and stops each row at a stop token. `Llama` builds one and calls
it; it needs no `Llama` itself, so it can be driven (and tested) with any model of the same interface.
"""

import codecs
import functools
import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from llama.model import Transformer
from llama.parallel_layers import use_parallel_layers
from llama.tokenizer import StopReason, Tokenizer, ToolCall, short_repr, token_id_list

# A one-token step: (tokens (bsz, 1), position as a one-element tensor) -> logits (bsz, 1, vocab_size).
DecodeStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StreamChunk:
    """New text for one prompt of a streaming call."""

    index: int  # which prompt or dialog of the batch
    text: str  # decoded text since this prompt's previous chunk
    finished: bool = False  # this prompt's last chunk
    stop_reason: Optional[StopReason] = None  # set on the last chunk
    n_tokens: int = 0  # tokens generated for this prompt so far
    tool_calls: Optional[List[ToolCall]] = None  # on a Llama 3.1+ chat answer's last chunk, if it called tools


@dataclass
class Batch:
    """The state of one batch while it decodes."""

    tokens: torch.Tensor  # (bsz, total_len), prompts right-padded with pad_id
    prompt_lens: List[int]
    token_logprobs: Optional[torch.Tensor]  # (bsz, total_len), logprob of each token given those before
    eos_reached: torch.Tensor  # (bsz,)
    cur_pos: int = 0  # positions [0, cur_pos) are final


class BatchDecoder:
    """Generates tokens for a batch of prompts with `model` (its `forward` and KV cache) and `tokenizer` (its pad
    and stop tokens); with `decode_step`, one-token steps run through it instead of `model.forward`."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, decode_step: Optional[DecodeStep] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.decode_step = decode_step

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def run(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float,
        top_p: float,
        logprobs: bool,
        echo: bool,
    ) -> Tuple[List[List[int]], List[Optional[List[float]]], List[StopReason]]:
        """Decode the whole batch; each row's output, its logprobs (None without `logprobs`) and why it stopped."""
        batch = self.start(prompt_tokens, max_gen_len, temperature, top_p, logprobs)
        for _ in self.steps(batch, temperature, top_p):
            pass
        return self.finish(batch, max_gen_len, echo)

    def stream(
        self, prompt_tokens: List[List[int]], max_gen_len: int, temperature: float, top_p: float
    ) -> Iterator[StreamChunk]:
        """Decode the batch, yielding each row's new text as soon as it is whole UTF-8."""
        batch = self.start(prompt_tokens, max_gen_len, temperature, top_p, logprobs=False)
        # Tokens can end inside a UTF-8 character; the incremental decoder holds such bytes back.
        decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in prompt_tokens]
        sent = [0] * len(prompt_tokens)  # generated tokens already decoded, per row
        finished = [False] * len(prompt_tokens)
        for batch in itertools.chain([batch], self.steps(batch, temperature, top_p)):
            for i, prompt_len in enumerate(batch.prompt_lens):
                end = min(batch.cur_pos, prompt_len + max_gen_len)
                if finished[i] or end <= prompt_len:
                    continue
                new_tokens, reason = self.cut_at_stop(batch.tokens[i, prompt_len + sent[i] : end].tolist())
                if reason is None and end == min(batch.tokens.shape[1], prompt_len + max_gen_len):
                    reason = "length"
                sent[i] += len(new_tokens)
                finished[i] = reason is not None
                text = decoders[i].decode(self.tokenizer.decode_bytes(new_tokens), final=finished[i])
                if text or finished[i]:
                    yield StreamChunk(i, text, finished[i], reason, n_tokens=sent[i])
        for i in range(len(prompt_tokens)):  # rows that had no room to generate anything
            if not finished[i]:
                text = decoders[i].decode(b"", final=True)
                yield StreamChunk(index=i, text=text, finished=True, stop_reason="length", n_tokens=sent[i])

    def start(
        self, prompt_tokens: Sequence[Sequence[int]], max_gen_len: int, temperature: float, top_p: float, logprobs: bool
    ) -> Batch:
        """Check the arguments and lay out the batch."""
        params = self.model.params
        check_sampling(temperature, top_p, max_gen_len)
        if max_gen_len is None:
            raise ValueError("max_gen_len must be an integer here; Llama's methods read None as max_seq_len - 1")
        max_gen_len = int(max_gen_len)
        if not isinstance(prompt_tokens, (list, tuple)) or any(not isinstance(t, (list, tuple)) for t in prompt_tokens):
            raise ValueError("prompt_tokens must be a list of token-ID lists; wrap a single prompt in a list")
        bsz = len(prompt_tokens)
        if bsz == 0:
            raise ValueError("No prompts given; pass at least one")
        if bsz > params.max_batch_size:
            raise ValueError(f"{bsz} prompts exceed max_batch_size={params.max_batch_size}; raise max_batch_size")
        for i, t in enumerate(prompt_tokens):
            if len(t) == 0:
                raise ValueError(f"Prompt {i} is empty; give every prompt at least one token")
            if len(t) > params.max_seq_len:
                raise ValueError(
                    f"Prompt {i} is {len(t)} tokens long, longer than max_seq_len={params.max_seq_len}; "
                    "shorten it or raise max_seq_len"
                )
        prompt_tokens = [
            token_id_list(t, params.vocab_size, where=f"Prompt {i}: ") for i, t in enumerate(prompt_tokens)
        ]
        total_len = min(params.max_seq_len, max_gen_len + max(len(t) for t in prompt_tokens))
        tokens = torch.full((bsz, total_len), self.tokenizer.pad_id, dtype=torch.long, device=self.device)
        for k, t in enumerate(prompt_tokens):
            tokens[k, : len(t)] = torch.tensor(t, dtype=torch.long, device=self.device)
        return Batch(
            tokens=tokens,
            prompt_lens=[len(t) for t in prompt_tokens],
            token_logprobs=torch.zeros_like(tokens, dtype=torch.float) if logprobs else None,
            eos_reached=torch.zeros(bsz, dtype=torch.bool, device=self.device),
            cur_pos=min(len(t) for t in prompt_tokens),
        )

    @torch.inference_mode()
    def steps(self, batch: Batch, temperature: float, top_p: float) -> Iterator[Batch]:
        """Fill the batch one position at a time, yielding it after each; stops when every row is done."""
        tokens, pad_id = batch.tokens, self.tokenizer.pad_id
        total_len = tokens.shape[1]
        is_prompt = tokens != pad_id
        stop_tokens = torch.tensor(sorted(self.tokenizer.stop_tokens), dtype=torch.long, device=self.device)
        want_logprobs = batch.token_logprobs is not None
        if batch.cur_pos == total_len and want_logprobs:
            # No room to generate: the prompts are only scored, token t against the logits of position t - 1.
            # (Meta's reference scores token t against its own position's logits here, a bug not carried over.)
            logits = self.model.forward(tokens, 0)
            batch.token_logprobs[:, 1:] = -F.cross_entropy(
                input=logits[:, :-1].transpose(1, 2), target=tokens[:, 1:], reduction="none", ignore_index=pad_id
            )
        prev_pos = 0
        for cur_pos in range(batch.cur_pos, total_len):
            if self.decode_step is not None and cur_pos - prev_pos == 1:
                position = torch.tensor([prev_pos], device=self.device)
                logits = self.decode_step(tokens[:, prev_pos:cur_pos], position)
            else:
                logits = self.model.forward(tokens[:, prev_pos:cur_pos], prev_pos, last_logits_only=not want_logprobs)
            next_token = sample_next(logits[:, -1], temperature, top_p).reshape(-1)
            # Rows whose prompt reaches this far keep their prompt token: the others' sample is not theirs.
            next_token = torch.where(is_prompt[:, cur_pos], tokens[:, cur_pos], next_token)
            tokens[:, cur_pos] = next_token
            if want_logprobs:
                batch.token_logprobs[:, prev_pos + 1 : cur_pos + 1] = -F.cross_entropy(
                    input=logits.transpose(1, 2),
                    target=tokens[:, prev_pos + 1 : cur_pos + 1],
                    reduction="none",
                    ignore_index=pad_id,
                )
            batch.eos_reached |= (~is_prompt[:, cur_pos]) & torch.isin(next_token, stop_tokens)
            batch.cur_pos = cur_pos + 1
            prev_pos = cur_pos
            yield batch
            if batch.eos_reached.all():
                break

    def finish(
        self, batch: Batch, max_gen_len: int, echo: bool
    ) -> Tuple[List[List[int]], List[Optional[List[float]]], List[StopReason]]:
        """Cut each row to its output: from 0 (echo) or the prompt end, up to max_gen_len, before a stop token."""
        token_logprobs = batch.token_logprobs.tolist() if batch.token_logprobs is not None else None
        out_tokens, out_logprobs, stop_reasons = [], [], []
        for i, toks in enumerate(batch.tokens.tolist()):
            prompt_len = batch.prompt_lens[i]
            start = 0 if echo else prompt_len
            toks = toks[start : prompt_len + max_gen_len]
            probs = token_logprobs[i][start : prompt_len + max_gen_len] if token_logprobs else None
            cut, reason = self.cut_at_stop(toks)
            out_tokens.append(cut)
            out_logprobs.append(probs[: len(cut)] if probs is not None else None)
            stop_reasons.append(reason or "length")
        return out_tokens, out_logprobs, stop_reasons

    def cut_at_stop(self, tokens: List[int]) -> Tuple[List[int], Optional[StopReason]]:
        """`tokens` up to the first stop token, and which kind of stop it was (None: no stop token)."""
        stop_at = [tokens.index(stop) for stop in self.tokenizer.stop_tokens if stop in tokens]
        if not stop_at:
            return tokens, None
        first = min(stop_at)
        return tokens[:first], "end_of_message" if tokens[first] == self.tokenizer.eom_id else "end_of_turn"


def check_sampling(temperature: float, top_p: float, max_gen_len: Optional[int]) -> None:
    """Raise a ValueError naming the sampling argument that cannot work (max_gen_len None: as long as fits).

    temperature and top_p are real numbers (a float, an int, a numpy float; not a bool), temperature finite and
    >= 0, top_p in (0, 1]; max_gen_len is as `checked_gen_len` takes it.
    """
    value = as_float(temperature)
    if value is None or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {short_repr(temperature)}")
    value = as_float(top_p)
    if value is None or not 0 < value <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {short_repr(top_p)}")
    checked_gen_len(max_gen_len)


def checked_gen_len(max_gen_len: Optional[int]) -> Optional[int]:
    """`max_gen_len` as a Python int (None stays None), or a ValueError unless it is an int >= 0 (numpy integers
    too; not a bool)."""
    if max_gen_len is None:
        return None
    if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, numbers.Integral) or max_gen_len < 0:
        raise ValueError(f"max_gen_len must be a non-negative integer or None, got {short_repr(max_gen_len)}")
    return int(max_gen_len)


def as_float(value) -> Optional[float]:
    """`value` as a float when it is a real number (not a bool) that a float can hold, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError):  # e.g. 10**400
        return None


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
    whose vectorised argmax takes some 11 us over Llama 3's 128256 logits, where torch's takes 130 (a scalar loop)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return torch.argmax(logits, dim=-1)


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
        # SmolLM2's rows (benchmarks/sampling.py) the nucleus ran 8 to 10 times longer than that bound. Rows that
        # the largest head would not hold either go to the full sort now.
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


def compiled_decode_step(model: Transformer) -> DecodeStep:
    """`model.decode_step` compiled by torch.compile, replayed as a CUDA graph on CUDA.

    fairscale's layers left in `model` (as after `llama.parallel_layers.unpack_layers`) are replaced with
    `llama.parallel_layers`' (the same weights and math) first: with theirs, the step would not compile to one
    graph.
    """
    use_parallel_layers(model)
    on_cuda = model.tok_embeddings.weight.is_cuda
    options = {
        "triton.cudagraphs": on_cuda,  # what mode="reduce-overhead" turns on
        "emulate_precision_casts": True,  # round bf16/fp16 intermediates where the eager path does
        # One row times a weight is a reduction that reads the weight once; searching its block sizes (seconds
        # more to compile) brings it to the memory's speed, and lets an int8 weight be widened inside the product.
        "coordinate_descent_tuning": on_cuda,
    }
    # Compiled without the inference mode that decode_step enters, which torch.compile cannot trace in a graph
    # of inference tensors with views (pytorch/pytorch#180823), and run inside it.
    step = torch.compile(functools.partial(Transformer.decode_step.__wrapped__, model), dynamic=False, options=options)

    def decode_step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            # A column of the batch's token table has its row stride, which changes with the table's length and
            # would compile the step again for each (contiguous() keeps it for one row); a copy's strides do not.
            return step(tokens.clone(memory_format=torch.contiguous_format), position)

    return decode_step
