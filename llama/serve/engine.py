"""Continuous batching: requests join the running batch at its next step and leave it at their stop, each in a row
of the model's KV cache at a position of its own.

Every `Engine.step` frees the rows of finished and cancelled requests, gives free rows to waiting requests, runs
one decode step over the rows in use (`RuntimeTransformer.decode_step` with a position per row), then runs new requests'
prompts, oldest first, each through the model in its own row alone, up to `prefill_chunk` tokens in all. A long
prompt is so spread over several steps, and the requests already running go on meanwhile.

A row keeps its keys and values when its request ends (`RuntimeTransformer.cached` says which tokens it holds). With
`prefix_cache`, a new request gets a free row where it overwrites nothing the row holds, the one that holds the most
of its prompt (a conversation's next turn finds its own row), else an empty one; where every free row would lose
tokens, the one used least recently. Before each prompt chunk, the longest start of the prompt that any row holds
is copied from it (`RuntimeTransformer.copy_cached`), which is far cheaper than running it again: requests that
share a few-shot context or a system prompt run it once, whichever rows they are given. (On a Llama 3.2 Vision model,
only what comes before a prompt's first image is reused; a request's images are encoded for its row as it starts.)

Each request samples with its own temperature, top_p and `torch.Generator`, as `Llama.generate` samples a batch of
one: greedy requests get the tokens they would get alone (up to the rounding of a batched product), and a seeded
request its own draws whatever else runs beside it.

With a `draft`, a request decodes speculatively while it runs alone (`llama.serve.speculation`).

Under torchrun every process holds a share of the model and must run each step with the others: the process of
rank 0 plans the step, sends the `Plan` to the others (`PlanChannel`), and all of them run it (`run_plan`); only
rank 0 samples. The others loop in `follow_plans`. Those three live in `llama.serve.engine_plan`.
"""

import collections
import itertools
import threading
import traceback
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch

from llama.arguments import DEFAULT_DRAFT_MAX
from llama.decoding.next_token import advance_grammars, masked_to_grammars, scores
from llama.decoding.sampling import sample_next
from llama.runtime import DecodeStep, RuntimeTransformer
from llama.runtime.cached_tokens import common_prefix_length
from llama.runtime.vision import RuntimeVisionText
from llama.serve.engine_plan import Plan, PlanChannel, run_plan
from llama.serve.requests import Output, QueueFull, Request
from llama.serve.speculation import Guesser, Speculation
from llama.tokenizer import Tokenizer, stop_reason
from llama.vision.batch import ImageTiles


@dataclass
class Row:
    """A request in its row of the KV cache."""

    request: Request
    generator: torch.Generator
    admitted: int  # order of arrival in the rows: the oldest prompt is prefilled first
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0  # tokens sampled
    next_token: Optional[int] = None  # the last token sampled: the next decode step's input
    guesser: Optional[Guesser] = None  # with a draft: guesses the tokens after the prompt and those sampled
    prompt_logprobs: List[Optional[Tuple[float, List[Tuple[int, float]]]]] = field(default_factory=lambda: [None])

    @property
    def position(self) -> int:
        """Where this row's next input goes in the cache: its next prompt chunk, or its last sampled token."""
        if self.next_token is None:
            return self.prefilled
        return len(self.request.prompt) + self.generated - 1


class Engine:
    """Serves requests from the rows of `model`'s KV cache (its max_batch_size), in a thread of its own (`run`).

    Args:
        model: The model; its max_batch_size and max_seq_len bound the rows and each request's tokens.
        tokenizer: For the stop tokens.
        decode_step: The one-token step to run (compiled, CUDA graphs); None: eagerly, `model.decode_step` (one
            request alone: `model.forward`, as `Llama.generate` steps).
        max_queue: Requests that may wait for a row; `submit` raises QueueFull beyond them.
        prefill_chunk: Most prompt tokens run in one step (all rows together); a longer prompt takes several.
        fixed_batch: Decode every row at every step, so the step's shapes never change (for torch.compile);
            otherwise the rows up to the last one in use.
        channel: Under torchrun, where the plans go to the other processes.
        prefix_cache: Reuse the keys and values that rows hold from earlier requests (see the module); False
            prefills every prompt from its first token.
        draft: "lookup", or a draft model (`Llama.build`'s `draft`): a request running alone decodes speculatively,
            up to `draft_max` guessed tokens a pass (`llama.serve.speculation`). Under torchrun, "lookup" only.
    """

    def __init__(
        self,
        model: RuntimeTransformer,
        tokenizer: Tokenizer,
        decode_step: Optional[DecodeStep] = None,
        max_queue: int = 64,
        prefill_chunk: int = 512,
        fixed_batch: bool = False,
        channel: Optional[PlanChannel] = None,
        prefix_cache: bool = True,
        draft: Union[str, RuntimeTransformer, None] = None,
        draft_max: int = DEFAULT_DRAFT_MAX,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.decode_step = decode_step
        self.max_queue, self.prefill_chunk, self.fixed_batch = max_queue, prefill_chunk, fixed_batch
        self.channel = channel
        self.prefix_cache = prefix_cache
        self.rows: List[Optional[Row]] = [None] * model.params.max_batch_size
        self.last_used = [0] * model.params.max_batch_size  # when each row last took or ended a request
        self.uses = itertools.count(1)
        self.reused = 0  # prompt tokens reused since the start
        self.waiting: collections.deque = collections.deque()
        self.wakeup = threading.Condition()
        self.stopping = False
        self.arrivals = itertools.count()
        self.sampled = 0  # tokens sampled since the start, stop tokens included
        self.speculation = None if draft is None else Speculation(draft, draft_max, distributed=channel is not None)
        self.takes_images = isinstance(model, RuntimeVisionText)
        self.images_to_show: List[Tuple[int, List[int], List[ImageTiles]]] = []  # for the next plan's `images`

    @property
    def max_seq_len(self) -> int:
        return self.model.params.max_seq_len

    def submit(self, request: Request) -> None:
        """Queue `request` for the next free row.

        Raises:
            ValueError: When its prompt and max_tokens do not fit in max_seq_len, or it has images for a text model.
            QueueFull: When max_queue requests are already waiting.
        """
        if request.images and not self.takes_images:
            raise ValueError("This model takes no images: it is a text model")
        if not request.prompt or len(request.prompt) + request.max_tokens > self.max_seq_len:
            raise ValueError(
                f"{len(request.prompt)} prompt tokens and max_tokens={request.max_tokens} exceed "
                f"max_seq_len={self.max_seq_len}"
            )
        with self.wakeup:
            free_rows = sum(row is None for row in self.rows)  # the next step admits that many
            if len(self.waiting) >= self.max_queue + free_rows:
                raise QueueFull(f"{self.max_queue} requests are already waiting for a row")
            self.waiting.append(request)
            self.wakeup.notify()

    def cancel(self, request: Request) -> None:
        """Stop `request`: its row is freed at the next step, and it gets no more outputs."""
        with self.wakeup:
            request.cancelled = True
            self.wakeup.notify()

    def load(self) -> dict:
        """Rows in use and free, requests waiting, tokens sampled so far and prompt tokens reused so far."""
        with self.wakeup:
            running = sum(row is not None for row in self.rows)
            load = {
                "running": running,
                "free_rows": len(self.rows) - running,
                "waiting": len(self.waiting),
                "sampled_tokens": self.sampled,
                "reused_prompt_tokens": self.reused,
            }
            if self.speculation is not None:
                load["speculative"] = self.speculation.report()
            return load

    def run(self) -> None:
        """Step while there is work, until `stop`; then tell the other processes to stop too."""
        while True:
            with self.wakeup:
                while not self.stopping and not self.waiting and all(row is None for row in self.rows):
                    self.wakeup.wait()
                if self.stopping:
                    break
            try:
                self.step()
            except Exception:  # a fault of the model's step: fail the requests in it and keep serving
                traceback.print_exc()
                self.fail_running()
        if self.channel is not None:
            self.channel.send(Plan(stop=True))

    def stop(self) -> None:
        """End `run` after the current step; requests still running or waiting get a "cancelled" finish."""
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
            for request in list(self.waiting) + [row.request for row in self.rows if row is not None]:
                if not request.cancelled:
                    request.emit(Output(finish="cancelled"))
                    request.cancelled = True
            self.waiting.clear()

    def step(self) -> None:
        with self.wakeup:
            self.release_cancelled()
            self.admit()
            plan = self.plan()
            alone = self.running_alone(plan)
        guesses = [] if alone is None else self.propose(plan, alone)  # outside the lock: a draft model runs here
        if self.channel is not None:
            self.channel.send(plan)
        decode_logits, prefill_logits = run_plan(self.model, self.decode_step, plan)
        if guesses:
            self.verify(alone, guesses, prefill_logits[0])
            return
        for i, logits in decode_logits.items():
            self.sample(i, self.rows[i], logits)
        for (i, start, chunk, every_position), logits in zip(plan.prefills, prefill_logits):
            row = self.rows[i]
            row.prefilled += len(chunk)
            if every_position:
                targets = row.request.prompt[start + 1 : start + len(chunk) + 1]  # each position's next token
                row.prompt_logprobs += scores(logits, targets, row.request.top_logprobs or 0)
                logits = logits[-1]
            if row.prefilled == len(row.request.prompt):
                self.prompt_done(i, row, logits)

    def prompt_done(self, i: int, row: Row, logits: torch.Tensor) -> None:
        """Row i's prompt has run: send its scores if asked for, then its first token (`sample`), or finish."""
        request = row.request
        if request.score_prompt:
            request.emit(Output(prompt_logprobs=row.prompt_logprobs, cached_tokens=request.cached_tokens))
        if request.max_tokens == 0:
            request.emit(Output(finish="length", cached_tokens=request.cached_tokens))
            self.release(i)
        else:
            self.sample(i, row, logits)

    def release(self, i: int) -> None:
        """Free row i; its keys and values stay for a later request, its images' do not."""
        self.rows[i] = None
        self.last_used[i] = next(self.uses)
        if self.takes_images:
            self.images_to_show.append((i, [], []))

    def release_cancelled(self) -> None:
        self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        for i, row in enumerate(self.rows):
            if row is not None and row.request.cancelled:
                self.release(i)

    def admit(self) -> None:
        """Give free rows to waiting requests, oldest first (see the module for which row)."""
        while self.waiting and None in self.rows:
            request = self.waiting.popleft()
            free = [i for i, row in enumerate(self.rows) if row is None]
            reusable = {i: self.reusable(i, request) for i in free}
            whole = {i: self.held_whole(i, request.prompt) for i in free}
            i = max(free, key=lambda i: (whole[i], reusable[i] if whole[i] else 0, -self.last_used[i]))
            generator = torch.Generator(self.model.tok_embeddings.weight.device)  # where the logits are drawn
            if request.seed is None:
                generator.seed()
            else:
                generator.manual_seed(request.seed)
            self.rows[i] = Row(request, generator, admitted=next(self.arrivals), prefilled=reusable[i])
            if self.speculation is not None:
                logprobs, grammar = request.top_logprobs is not None, request.constraint is not None
                self.rows[i].guesser = self.speculation.guesser_for(request.prompt, logprobs, grammar)
            self.last_used[i] = next(self.uses)
            self.reuse(request, reusable[i])
            if self.takes_images:
                self.images_to_show.append((i, request.prompt, request.images))

    def held_whole(self, i: int, prompt: List[int]) -> bool:
        """Whether `prompt` begins with all that row i holds, so that running it there loses nothing."""
        held = self.model.cached[i]
        return self.prefix_cache and prompt[: len(held)] == held

    def reusable(self, i: int, request: Request) -> int:
        """Tokens at the start of `request`'s prompt that row i holds (0 without prefix_cache, or where the whole
        prompt must run to be scored)."""
        if not self.prefix_cache or request.score_prompt:
            return 0
        return self.model.cached.reusable(i, request.prompt)

    def reuse(self, request: Request, tokens: int) -> None:
        request.cached_tokens += tokens
        self.reused += tokens

    def copy_longer_prefix(self, plan: Plan, i: int) -> None:
        """Where another row holds more of row i's prompt than row i, plan to copy it before row i's next chunk."""
        row = self.rows[i]
        held = {j: self.reusable(j, row.request) for j in range(len(self.rows)) if j != i}
        for _, target, start, _ in plan.copies:  # a row copied into earlier in this step holds only what is before
            held[target] = min(held[target], start)
        source = max(held, key=held.get, default=None)
        if source is not None and held[source] > row.prefilled:
            plan.copies.append((source, i, row.prefilled, held[source]))  # row i holds the tokens before
            self.reuse(row.request, held[source] - row.prefilled)
            row.prefilled = held[source]

    def plan(self) -> Plan:
        """Decode every row that has a sampled token; prefill the oldest unfinished prompts, prefill_chunk tokens in
        all."""
        plan = Plan(images=self.images_to_show)
        self.images_to_show = []
        prefilling = sorted((row.admitted, i) for i, row in enumerate(self.rows) if row and row.next_token is None)
        for _, i in prefilling:
            self.copy_longer_prefix(plan, i)
        decoding = [i for i, row in enumerate(self.rows) if row is not None and row.next_token is not None]
        if decoding:
            n = len(self.rows) if self.fixed_batch else decoding[-1] + 1
            plan.decode_rows = decoding
            for i, row in enumerate(self.rows[:n]):
                # A row with nothing to decode gets token 0 at its next free position (when free, the one after the
                # tokens it holds): it writes there what its own prompt or token overwrites before the row ever
                # attends to it, and leaves the tokens before it in place for a later request.
                plan.decode_tokens.append(row.next_token if row is not None and row.next_token is not None else 0)
                free_position = min(len(self.model.cached[i]), self.max_seq_len - 1)
                plan.decode_positions.append(row.position if row is not None else free_position)
        budget = self.prefill_chunk
        for n, (_, i) in enumerate(prefilling):
            if budget == 0:
                break
            row = self.rows[i]
            older = [self.rows[j] for _, j in prefilling[:n]]
            if self.prefix_cache and not row.request.score_prompt and self.runs_later_in_older_row(row, older):
                continue  # copied once an older row has run it
            chunk = row.request.prompt[row.prefilled : row.prefilled + budget]
            plan.prefills.append((i, row.prefilled, chunk, row.request.score_prompt))
            budget -= len(chunk)
        return plan

    def running_alone(self, plan: Plan) -> Optional[int]:
        """The row that may decode speculatively in `plan`: the only one in use, decoding, with a guesser (no
        logprobs, no grammar), while nothing waits; None otherwise."""
        in_use = [i for i, row in enumerate(self.rows) if row is not None]
        if len(in_use) != 1 or self.waiting or plan.prefills or plan.decode_rows != in_use:
            return None
        return in_use[0] if self.rows[in_use[0]].guesser is not None else None

    def propose(self, plan: Plan, i: int) -> List[int]:
        """Row i's guesses, as many as its guesser allows and its max_tokens and max_seq_len leave room for with
        the model's own token after them; where there are some, `plan`'s decode step becomes a pass over
        the row's last token and the guesses. Returns the guesses (none: `plan` is left a plain step)."""
        row = self.rows[i]
        room = min(row.request.max_tokens - row.generated, self.max_seq_len - row.position) - 1
        guesses = self.speculation.guesses(row.guesser, room)
        if guesses:
            plan.decode_tokens, plan.decode_positions, plan.decode_rows = [], [], []
            plan.prefills = [(i, row.position, [row.next_token] + guesses, True)]
        return guesses

    def verify(self, i: int, guesses: List[int], logits: torch.Tensor) -> None:
        """Hand row i's request the guesses the model agrees with and its own token after them. The refused
        guesses' keys and values stay in the row, recorded as such, until the next step overwrites them."""
        row = self.rows[i]
        request = row.request
        args = (request.temperature, request.top_p, row.generator)
        for token in self.speculation.accept(row.guesser, guesses, logits, *args):
            if self.rows[i] is not row:  # it stopped
                return
            self.take(i, row, token)

    @staticmethod
    def runs_later_in_older_row(row: Row, older: List[Row]) -> bool:
        """Whether an older row still prefilling will run the next tokens of `row`'s prompt itself."""
        prompt = row.request.prompt
        return any(common_prefix_length(other.request.prompt, prompt) > row.prefilled for other in older)

    def sample(self, i: int, row: Row, logits: torch.Tensor) -> None:
        """Draw row i's next token from its logits (vocab_size,) and hand it to the request (`take`)."""
        request = row.request
        under_grammar = [] if request.constraint is None else [(0, request.constraint)]
        drawn = sample_next(
            masked_to_grammars(logits[None], under_grammar), request.temperature, request.top_p, row.generator
        )
        advance_grammars(under_grammar, drawn.reshape(-1))
        self.take(i, row, int(drawn), logits)

    def take(self, i: int, row: Row, token: int, logits: Optional[torch.Tensor] = None) -> None:
        """Hand row i's next token to its request (with its logprobs from `logits`, where asked for), and free the
        row when the request is done."""
        request = row.request
        if row.guesser is not None:
            row.guesser.proposer.extend([token])
        row.generated += 1
        self.sampled += 1
        if token in self.tokenizer.stop_tokens:
            request.emit(Output(finish=stop_reason(self.tokenizer, token), cached_tokens=request.cached_tokens))
            self.release(i)
            return
        output = Output(token=token, cached_tokens=request.cached_tokens)
        if request.top_logprobs is not None:
            ((output.logprob, top),) = scores(logits[None], [token], request.top_logprobs)
            output.top_logprobs = top or None
        request.emit(output)
        if row.generated >= request.max_tokens:
            request.emit(Output(finish="length", cached_tokens=request.cached_tokens))
            self.release(i)
        else:
            row.next_token = token

    def fail_running(self) -> None:
        with self.wakeup:
            for i, row in enumerate(self.rows):
                if row is not None:
                    row.request.emit(Output(finish="error"))
                    self.release(i)
