"""Batch decoding: from token-ID prompts to generated tokens, for a model, a tokenizer and a one-token step.

`BatchDecoder` lays the prompts out in one right-padded table, runs the model over the positions up to the
shortest prompt's end (from the first position some row's cache does not already hold: prefix reuse), samples each
next token, and stops each row at a stop token. `Llama` builds one and calls
it; it needs no `Llama` itself, so it can be driven (and tested) with any model of the same interface.
"""

import codecs
import itertools
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from llama.checks import check_sampling, checked_gen_len, token_id_list
from llama.runtime import DecodeStep, RuntimeTransformer
from llama.sampling import sample_next
from llama.structured import Constraint
from llama.tokenizer import StopReason, Tokenizer, ToolCall, stop_reason


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
    constraints: Optional[List[Optional[Constraint]]] = None  # a grammar per row for its output (llama.structured)
    reused: int = 0  # positions [0, reused) of every row were already in the KV cache: the model starts after them

    def constrained(self, cur_pos: int) -> List[Tuple[int, Constraint]]:
        """(row, constraint) of the rows whose token at `cur_pos` is output under a grammar (past their prompt)."""
        return [
            (row, constraint)
            for row, constraint in enumerate(self.constraints or [])
            if constraint is not None and cur_pos >= self.prompt_lens[row]
        ]


class BatchDecoder:
    """Generates tokens for a batch of prompts with `model` (its `forward` and KV cache) and `tokenizer` (its pad
    and stop tokens); with `decode_step`, one-token steps run through it instead of `model.forward`.

    With `prefix_cache`, prompt i goes to cache row i, and the positions that every row of the batch already holds
    (`model.cached`: the last call's prompt and output, as far as the new prompt repeats them) are not run again.
    `last_reused` says how many positions of each row the last call reused."""

    def __init__(
        self,
        model: RuntimeTransformer,
        tokenizer: Tokenizer,
        decode_step: Optional[DecodeStep] = None,
        prefix_cache: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.decode_step = decode_step
        self.prefix_cache = prefix_cache
        self.last_reused: List[int] = []

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    def gen_len(self, max_gen_len: Optional[int]) -> int:
        """`max_gen_len` as `Llama`'s methods take it, as an int: None means as many tokens as the context allows
        (max_seq_len - 1)."""
        max_gen_len = checked_gen_len(max_gen_len)
        return self.model.params.max_seq_len - 1 if max_gen_len is None else max_gen_len

    def run(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float,
        top_p: float,
        logprobs: bool,
        echo: bool,
        constraints: Optional[List[Optional[Constraint]]] = None,
    ) -> Tuple[List[List[int]], List[Optional[List[float]]], List[StopReason]]:
        """Decode the whole batch; each row's output, its logprobs (None without `logprobs`) and why it stopped.
        Row i's output follows `constraints[i]`, where given."""
        # With echo, logprobs are wanted from the prompt's second token on: every position must run.
        batch = self.start(prompt_tokens, max_gen_len, temperature, top_p, logprobs, reuse=not (logprobs and echo))
        batch.constraints = constraints
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
        self,
        prompt_tokens: Sequence[Sequence[int]],
        max_gen_len: int,
        temperature: float,
        top_p: float,
        logprobs: bool,
        reuse: bool = True,
    ) -> Batch:
        """Check the arguments and lay out the batch, reusing the cached prefix where `reuse` and `prefix_cache`."""
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
        reused = 0
        if reuse and self.prefix_cache:  # one start for the whole batch: the least any row holds
            reused = min(self.model.cached.reusable(i, t) for i, t in enumerate(prompt_tokens))
        self.last_reused = [reused] * bsz
        return Batch(
            tokens=tokens,
            prompt_lens=[len(t) for t in prompt_tokens],
            token_logprobs=torch.zeros_like(tokens, dtype=torch.float) if logprobs else None,
            eos_reached=torch.zeros(bsz, dtype=torch.bool, device=self.device),
            cur_pos=min(len(t) for t in prompt_tokens),
            reused=reused,
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
        prev_pos = batch.reused
        for cur_pos in range(batch.cur_pos, total_len):
            if self.decode_step is not None and cur_pos - prev_pos == 1:
                position = torch.tensor([prev_pos], device=self.device)
                logits = self.decode_step(tokens[:, prev_pos:cur_pos], position)
                for row, token in enumerate(tokens[:, prev_pos].tolist()):  # `forward` records its own writes
                    self.model.cached.wrote(row, prev_pos, [token])
            else:
                logits = self.model.forward(tokens[:, prev_pos:cur_pos], prev_pos, last_logits_only=not want_logprobs)
            constrained = batch.constrained(cur_pos)
            next_token = sample_next(allowed(logits[:, -1], constrained), temperature, top_p).reshape(-1)
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
            for row, constraint in constrained:
                constraint.advance(int(next_token[row]))
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
        return tokens[:first], stop_reason(self.tokenizer, tokens[first])


def allowed(logits: torch.Tensor, constrained: List[Tuple[int, Constraint]]) -> torch.Tensor:
    """The next-token logits (bsz, vocab_size), those of the `constrained` rows masked to what their grammar allows."""
    if not constrained:
        return logits
    logits = logits.clone()
    for row, constraint in constrained:
        logits[row] = constraint.mask(logits[row])
    return logits
