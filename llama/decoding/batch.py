"""Batch decoding, as Meta's `generate` does it: from token-ID prompts to generated tokens, their logprobs and why
each row stopped, for a model, a tokenizer and a one-token step. Text is `llama.text`'s.

`BatchDecoder` lays the prompts out in one right-padded table, runs the model over the positions up to the
shortest prompt's end (from the first position some row's cache does not already hold: prefix reuse), samples each
next token, and stops each row at a stop token. With a draft (`llama.decoding.speculative`), one prompt at a time
decodes speculatively: several guessed tokens checked in one pass. `Llama` builds one and calls
it; it needs no `Llama` itself, so it can be driven (and tested) with any model of the same interface.
"""

import itertools
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from llama.arguments import DEFAULT_DRAFT_MAX, LOOKUP, check_sampling, checked_gen_len, token_id_list
from llama.checkpoint import checked_int
from llama.decoding.grammar import Constraint
from llama.decoding.next_token import advance_grammars, cut_at_stop, masked_to_grammars, token_logprobs
from llama.decoding.sampling import sample_next
from llama.decoding.speculative import (
    DraftCounts,
    DraftLength,
    accept_greedy,
    accept_sampled,
    proposer_for,
)
from llama.runtime import DecodeStep, RuntimeTransformer
from llama.tokenizer import StopReason, Tokenizer


@dataclass
class NewTokens:
    """What one row of a streamed batch generated since its previous `NewTokens`."""

    index: int  # which prompt of the batch
    tokens: List[int]  # the new tokens, none of them a stop token
    stop_reason: Optional[StopReason] = None  # set on the row's last one


@dataclass
class Batch:
    """The state of one batch while it decodes."""

    tokens: torch.Tensor  # (bsz, total_len), prompts right-padded with pad_id
    prompt_lens: List[int]
    token_logprobs: Optional[torch.Tensor]  # (bsz, total_len), logprob of each token given those before
    eos_reached: torch.Tensor  # (bsz,)
    cur_pos: int = 0  # positions [0, cur_pos) are final
    constraints: Optional[List[Optional[Constraint]]] = None  # a grammar per row for its output
    reused: int = 0  # positions [0, reused) of every row were already in the KV cache: the model starts after them

    def rows_under_grammar(self, cur_pos: int) -> List[Tuple[int, Constraint]]:
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
    `last_reused` says how many positions of each row the last call reused.

    With `draft` ("lookup": `PromptLookup`; a draft model: `DraftModel`), a batch of one prompt that asks for no
    logprobs and no grammar decodes speculatively, up to `draft_max` guessed tokens a pass; `last_drafts` counts
    what that did."""

    def __init__(
        self,
        model: RuntimeTransformer,
        tokenizer: Tokenizer,
        decode_step: Optional[DecodeStep] = None,
        prefix_cache: bool = True,
        draft: Union[str, RuntimeTransformer, None] = None,
        draft_max: int = DEFAULT_DRAFT_MAX,
    ):
        if isinstance(draft, str) and draft != LOOKUP:
            raise ValueError(f"draft={draft!r} is not a proposer; use {LOOKUP!r}, a draft model, or None")
        draft_max = checked_int("draft_max", draft_max, 1)
        self.model = model
        self.tokenizer = tokenizer
        self.decode_step = decode_step
        self.prefix_cache = prefix_cache
        self.draft, self.draft_max = draft, draft_max
        self.last_reused: List[int] = []
        self.last_drafts = DraftCounts()

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
    ) -> Iterator[NewTokens]:
        """Decode the batch, yielding each row's new tokens after every step that gives it some, and each row's stop
        reason with its last ones (`llama.text.stream_chunks` makes text of them)."""
        batch = self.start(prompt_tokens, max_gen_len, temperature, top_p, logprobs=False)
        sent = [0] * len(prompt_tokens)  # generated tokens already yielded, per row
        finished = [False] * len(prompt_tokens)
        for batch in itertools.chain([batch], self.steps(batch, temperature, top_p)):
            for i, prompt_len in enumerate(batch.prompt_lens):
                end = min(batch.cur_pos, prompt_len + max_gen_len)
                if finished[i] or end <= prompt_len:
                    continue
                new_tokens, reason = cut_at_stop(self.tokenizer, batch.tokens[i, prompt_len + sent[i] : end].tolist())
                if reason is None and end == min(batch.tokens.shape[1], prompt_len + max_gen_len):
                    reason = "length"
                sent[i] += len(new_tokens)
                finished[i] = reason is not None
                if new_tokens or finished[i]:
                    yield NewTokens(i, new_tokens, reason)
        for i in range(len(prompt_tokens)):  # rows that had no room to generate anything
            if not finished[i]:
                yield NewTokens(i, [], "length")

    def checked_prompts(
        self, prompt_tokens: Sequence[Sequence[int]], max_gen_len: int, temperature: float, top_p: float
    ) -> List[List[int]]:
        """The prompts as lists of ints, after checking them and the sampling arguments (a ValueError names what is
        wrong): before anything costly is done for a batch, such as reading its images."""
        params = self.model.params
        check_sampling(temperature, top_p, max_gen_len)
        if max_gen_len is None:
            raise ValueError("max_gen_len must be an integer here; Llama's methods read None as max_seq_len - 1")
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
        return [token_id_list(t, params.vocab_size, where=f"Prompt {i}: ") for i, t in enumerate(prompt_tokens)]

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
        prompt_tokens = self.checked_prompts(prompt_tokens, max_gen_len, temperature, top_p)
        params = self.model.params
        max_gen_len = int(max_gen_len)
        bsz = len(prompt_tokens)
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

    def speculates(self, batch: Batch) -> bool:
        """Whether `batch` decodes speculatively: with a draft, for one prompt, with room to generate, and neither
        logprobs nor a grammar asked for (those run a position at a time)."""
        plain = batch.token_logprobs is not None or any(c is not None for c in batch.constraints or [])
        return (
            self.draft is not None
            and len(batch.prompt_lens) == 1
            and batch.cur_pos < batch.tokens.shape[1]
            and not plain
        )

    @torch.inference_mode()
    def steps(self, batch: Batch, temperature: float, top_p: float) -> Iterator[Batch]:
        """Fill the batch one position at a time (or several, speculating), yielding it after each step; stops when
        every row is done."""
        self.last_drafts = DraftCounts()
        if self.speculates(batch):
            yield from self.speculative_steps(batch, temperature, top_p)
            return
        tokens, pad_id = batch.tokens, self.tokenizer.pad_id
        total_len = tokens.shape[1]
        is_prompt = tokens != pad_id
        stop_tokens = torch.tensor(sorted(self.tokenizer.stop_tokens), dtype=torch.long, device=self.device)
        want_logprobs = batch.token_logprobs is not None
        if batch.cur_pos == total_len and want_logprobs:
            # No room to generate: the prompts are only scored, token t against the logits of position t - 1
            # (docs/differences.md: the fixed reference bug).
            logits = self.model.forward(tokens, 0)
            batch.token_logprobs[:, 1:] = token_logprobs(logits[:, :-1], tokens[:, 1:], pad_id)
        prev_pos = batch.reused
        for cur_pos in range(batch.cur_pos, total_len):
            logits = self.run_model(tokens[:, prev_pos:cur_pos], prev_pos, last_logits_only=not want_logprobs)
            under_grammar = batch.rows_under_grammar(cur_pos)
            next_token = sample_next(masked_to_grammars(logits[:, -1], under_grammar), temperature, top_p).reshape(-1)
            # Rows whose prompt reaches this far keep their prompt token: the others' sample is not theirs.
            next_token = torch.where(is_prompt[:, cur_pos], tokens[:, cur_pos], next_token)
            tokens[:, cur_pos] = next_token
            if want_logprobs:
                targets = tokens[:, prev_pos + 1 : cur_pos + 1]
                batch.token_logprobs[:, prev_pos + 1 : cur_pos + 1] = token_logprobs(logits, targets, pad_id)
            batch.eos_reached |= (~is_prompt[:, cur_pos]) & torch.isin(next_token, stop_tokens)
            advance_grammars(under_grammar, next_token)
            batch.cur_pos = cur_pos + 1
            prev_pos = cur_pos
            yield batch
            if batch.eos_reached.all():
                break

    def run_model(self, tokens: torch.Tensor, start_pos: int, last_logits_only: bool) -> torch.Tensor:
        """The model's logits for `tokens` at positions from `start_pos` on: one position per row through the decode
        step where there is one, else through `forward`."""
        if self.decode_step is None or tokens.shape[1] != 1:
            return self.model.forward(tokens, start_pos, last_logits_only=last_logits_only)
        logits = self.decode_step(tokens, torch.tensor([start_pos], device=self.device))
        for row, token in enumerate(tokens[:, 0].tolist()):  # `forward` records its own writes
            self.model.cached.wrote(row, start_pos, [token])
        return logits

    def speculative_steps(self, batch: Batch, temperature: float, top_p: float) -> Iterator[Batch]:
        """`steps` for one prompt with a draft: after the prompt, each pass runs the last token and the guesses
        after it (`proposer_for` the draft, as many as `DraftLength` says), keeps the guesses the model agrees with
        (`accept_greedy`, `accept_sampled`) and the model's own token after them. Yields after each pass.

        A refused guess needs no rollback of the cache: its keys and values are those of the tokens before it, kept,
        and of itself, so `model.cached` names truly what the row holds; the next pass starts at the first refused
        position and overwrites from there."""
        tokens, total_len = batch.tokens, batch.tokens.shape[1]
        stop_tokens = self.tokenizer.stop_tokens
        proposer = proposer_for(self.draft, tokens[0, : batch.cur_pos].tolist())
        length, counts = DraftLength(self.draft_max), self.last_drafts
        logits = self.run_model(tokens[:, batch.reused : batch.cur_pos], batch.reused, last_logits_only=True)
        new = sample_next(logits[:, -1], temperature, top_p).reshape(-1).tolist()
        while True:
            stop = next((i for i, token in enumerate(new) if token in stop_tokens), None)
            new = new if stop is None else new[: stop + 1]
            cur_pos = batch.cur_pos
            tokens[0, cur_pos : cur_pos + len(new)] = torch.tensor(new, dtype=torch.long, device=self.device)
            proposer.extend(new)
            batch.cur_pos = cur_pos + len(new)
            batch.eos_reached[0] = stop is not None
            yield batch
            if stop is not None or batch.cur_pos == total_len:
                return
            # Room for the guesses and the model's token after them: the table ends at total_len.
            draft = proposer.propose(min(length.next(), total_len - batch.cur_pos - 1))
            start = batch.cur_pos - 1
            guessed = torch.tensor([draft], dtype=torch.long, device=self.device)
            logits = self.run_model(torch.cat([tokens[:, start : start + 1], guessed], dim=1), start, not draft)
            counts.passes += 1
            if not draft:
                new = sample_next(logits[:, -1], temperature, top_p).reshape(-1).tolist()
                continue
            if temperature == 0:
                accepted, token = accept_greedy(logits[0], draft)
            else:
                accepted, token = accept_sampled(logits[0], draft, temperature, top_p)
            counts.proposed, counts.accepted = counts.proposed + len(draft), counts.accepted + accepted
            length.update(len(draft), accepted)
            new = draft[:accepted] + [token]

    def finish(
        self, batch: Batch, max_gen_len: int, echo: bool
    ) -> Tuple[List[List[int]], List[Optional[List[float]]], List[StopReason]]:
        """Cut each row to its output: from 0 (echo) or the prompt end, up to max_gen_len, before a stop token."""
        all_logprobs = batch.token_logprobs.tolist() if batch.token_logprobs is not None else None
        out_tokens, out_logprobs, stop_reasons = [], [], []
        for i, toks in enumerate(batch.tokens.tolist()):
            prompt_len = batch.prompt_lens[i]
            start = 0 if echo else prompt_len
            toks = toks[start : prompt_len + max_gen_len]
            probs = all_logprobs[i][start : prompt_len + max_gen_len] if all_logprobs else None
            cut, reason = cut_at_stop(self.tokenizer, toks)
            out_tokens.append(cut)
            out_logprobs.append(probs[: len(cut)] if probs is not None else None)
            stop_reasons.append(reason or "length")
        return out_tokens, out_logprobs, stop_reasons
