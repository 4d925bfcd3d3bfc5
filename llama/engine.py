"""Continuous batching: requests join the running batch at its next step and leave it at their stop, each in a row
of the model's KV cache at a position of its own.

Every `Engine.step` frees the rows of finished and cancelled requests, gives free rows to waiting requests, runs
one decode step over the rows in use (`RuntimeTransformer.decode_step` with a position per row), then runs new requests'
prompts, oldest first, each through the model in its own row alone, up to `prefill_chunk` tokens in all. A long
prompt is so spread over several steps, and the requests already running go on meanwhile.

Each request samples with its own temperature, top_p and `torch.Generator`, as `Llama.generate` samples a batch of
one: greedy requests get the tokens they would get alone (up to the rounding of a batched product), and a seeded
request its own draws whatever else runs beside it.

Under torchrun every process holds a share of the model and must run each step with the others: the process of
rank 0 plans the step, sends the `Plan` to the others (`PlanChannel`), and all of them run it (`run_plan`); only
rank 0 samples. The others loop in `follow_plans`.
"""

import collections
import itertools
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from llama.runtime import DecodeStep, RuntimeTransformer
from llama.sampling import sample_next
from llama.tokenizer import Tokenizer, stop_reason

# A server idles between requests for as long as it likes: the plan broadcast gets its own, patient group.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass
class Output:
    """What a request gets from the engine thread: a token, or, last, why it finished."""

    token: Optional[int] = None
    logprob: Optional[float] = None  # the token's log-probability under the model's logits (no temperature)
    top_logprobs: Optional[List[Tuple[int, float]]] = None  # the most likely tokens and theirs, when asked for
    finish: Optional[str] = None  # "end_of_turn", "end_of_message", "length"; "error", "cancelled" (shutdown)


@dataclass
class Request:
    """One prompt to continue. `emit` is called from the engine's thread with each `Output`, in order."""

    prompt: List[int]
    max_tokens: int
    temperature: float
    top_p: float
    emit: Callable[[Output], None]
    seed: Optional[int] = None  # None: draws from a generator seeded at random
    top_logprobs: Optional[int] = None  # None: no logprobs; k: each token's logprob and the k likeliest
    cancelled: bool = False


class QueueFull(Exception):
    """Every row is busy and the waiting queue is full."""


@dataclass
class Row:
    """A request in its row of the KV cache."""

    request: Request
    generator: torch.Generator
    admitted: int  # order of arrival in the rows: the oldest prompt is prefilled first
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0  # tokens sampled
    next_token: Optional[int] = None  # the last token sampled: the next decode step's input

    @property
    def position(self) -> int:
        """Where this row's next input goes in the cache: its next prompt chunk, or its last sampled token."""
        if self.next_token is None:
            return self.prefilled
        return len(self.request.prompt) + self.generated - 1


@dataclass
class Plan:
    """One step's work for the model, the same in every process. Rows beyond the decode lists, and rows of the
    decode lists with nothing to decode, compute nothing anyone reads (see `Engine.plan`)."""

    decode_tokens: List[int] = field(default_factory=list)  # one per row 0..n-1 (empty: no decode step)
    decode_positions: List[int] = field(default_factory=list)
    decode_rows: List[int] = field(default_factory=list)  # those of rows 0..n-1 whose logits are wanted
    prefills: List[Tuple[int, int, List[int]]] = field(default_factory=list)  # (row, start position, prompt chunk)
    stop: bool = False  # the server is shutting down: followers return


@torch.inference_mode()
def run_plan(
    model: RuntimeTransformer, decode_step: Optional[DecodeStep], plan: Plan
) -> Tuple[Dict[int, torch.Tensor], List[torch.Tensor]]:
    """Run one step: the decode rows (through `decode_step`; None: eagerly), then the prompt chunks. Returns the
    next-token logits (vocab_size,) of each of plan.decode_rows, by row, and the last logits of each chunk."""
    device = model.tok_embeddings.weight.device
    decode_logits, prefill_logits = {}, []
    if len(plan.decode_rows) == 1 and decode_step is None:
        # One request decoding alone, eagerly: the step Llama.generate takes (`forward` from an int position), so
        # that its tokens are generate's in every dtype. The batched step rounds otherwise in bfloat16.
        (row,) = plan.decode_rows
        token = torch.tensor([[plan.decode_tokens[row]]], dtype=torch.long, device=device)  # (1, 1)
        logits = model.forward(token, plan.decode_positions[row], last_logits_only=True, first_row=row)
        decode_logits[row] = logits[0, -1]
    elif plan.decode_rows:
        tokens = torch.tensor(plan.decode_tokens, dtype=torch.long, device=device)[:, None]  # (n, 1)
        positions = torch.tensor(plan.decode_positions, dtype=torch.long, device=device)  # (n,)
        logits = (decode_step or model.decode_step)(tokens, positions)[:, -1]
        decode_logits = {i: logits[i] for i in plan.decode_rows}  # views: no copy of the (n, vocab_size) logits
    for row, start, chunk in plan.prefills:
        # After the decode step, whose write at this row's position (an input nobody reads) this chunk overwrites.
        tokens = torch.tensor([chunk], dtype=torch.long, device=device)  # (1, len(chunk))
        prefill_logits.append(model.forward(tokens, start, last_logits_only=True, first_row=row)[0, -1])
    return decode_logits, prefill_logits


class PlanChannel:
    """Rank 0's plans, broadcast to every process of the torchrun job."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, plan: Plan) -> None:
        dist.broadcast_object_list([plan], src=0, group=self.group)

    def receive(self) -> Plan:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def follow_plans(model: RuntimeTransformer, decode_step: Optional[DecodeStep], channel: PlanChannel) -> None:
    """Run rank 0's plans in this process until it sends the stop."""
    while not (plan := channel.receive()).stop:
        run_plan(model, decode_step, plan)


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
    ):
        self.model, self.tokenizer = model, tokenizer
        self.decode_step = decode_step
        self.max_queue, self.prefill_chunk, self.fixed_batch = max_queue, prefill_chunk, fixed_batch
        self.channel = channel
        self.rows: List[Optional[Row]] = [None] * model.params.max_batch_size
        self.waiting: collections.deque = collections.deque()
        self.wakeup = threading.Condition()
        self.stopping = False
        self.arrivals = itertools.count()
        self.sampled = 0  # tokens sampled since the start, stop tokens included

    @property
    def max_seq_len(self) -> int:
        return self.model.params.max_seq_len

    def submit(self, request: Request) -> None:
        """Queue `request` for the next free row.

        Raises:
            ValueError: When its prompt and max_tokens do not fit in max_seq_len.
            QueueFull: When max_queue requests are already waiting.
        """
        if not request.prompt or len(request.prompt) + max(request.max_tokens, 1) > self.max_seq_len:
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
        """Rows in use and free, requests waiting, and tokens sampled so far."""
        with self.wakeup:
            running = sum(row is not None for row in self.rows)
            free = len(self.rows) - running
            return {"running": running, "free_rows": free, "waiting": len(self.waiting), "sampled_tokens": self.sampled}

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
        if self.channel is not None:
            self.channel.send(plan)
        decode_logits, prefill_logits = run_plan(self.model, self.decode_step, plan)
        for i, logits in decode_logits.items():
            self.sample(i, self.rows[i], logits)
        for (i, _, chunk), logits in zip(plan.prefills, prefill_logits):
            row = self.rows[i]
            row.prefilled += len(chunk)
            if row.prefilled == len(row.request.prompt):
                self.sample(i, row, logits)

    def release_cancelled(self) -> None:
        self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        for i, row in enumerate(self.rows):
            if row is not None and row.request.cancelled:
                self.rows[i] = None

    def admit(self) -> None:
        for i in range(len(self.rows)):
            if self.rows[i] is None and self.waiting:
                request = self.waiting.popleft()
                generator = torch.Generator(self.model.tok_embeddings.weight.device)  # where the logits are drawn
                if request.seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(request.seed)
                self.rows[i] = Row(request, generator, admitted=next(self.arrivals))

    def plan(self) -> Plan:
        """Decode every row that has a sampled token; prefill the oldest unfinished prompts, prefill_chunk tokens in
        all."""
        plan = Plan()
        decoding = [i for i, row in enumerate(self.rows) if row is not None and row.next_token is not None]
        if decoding:
            n = len(self.rows) if self.fixed_batch else decoding[-1] + 1
            plan.decode_rows = decoding
            for row in self.rows[:n]:
                # A row with nothing to decode gets token 0 at its next free position (0 when free): it writes
                # there what its own prompt or token overwrites before the row ever attends to it.
                plan.decode_tokens.append(row.next_token if row is not None and row.next_token is not None else 0)
                plan.decode_positions.append(row.position if row is not None else 0)
        prefilling = sorted((row.admitted, i) for i, row in enumerate(self.rows) if row and row.next_token is None)
        budget = self.prefill_chunk
        for _, i in prefilling:
            if budget == 0:
                break
            row = self.rows[i]
            chunk = row.request.prompt[row.prefilled : row.prefilled + budget]
            plan.prefills.append((i, row.prefilled, chunk))
            budget -= len(chunk)
        return plan

    def sample(self, i: int, row: Row, logits: torch.Tensor) -> None:
        """Draw row i's next token from its logits (vocab_size,), hand it to the request, and free the row when
        the request is done."""
        request = row.request
        token = int(sample_next(logits[None], request.temperature, request.top_p, row.generator))
        row.generated += 1
        self.sampled += 1
        if token in self.tokenizer.stop_tokens:
            request.emit(Output(finish=stop_reason(self.tokenizer, token)))
            self.rows[i] = None
            return
        output = Output(token=token)
        if request.top_logprobs is not None:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            output.logprob = float(logprobs[token])
            if request.top_logprobs:
                values, tokens = torch.topk(logprobs, request.top_logprobs)
                output.top_logprobs = list(zip(tokens.tolist(), values.tolist()))
        request.emit(output)
        if row.generated >= request.max_tokens:
            request.emit(Output(finish="length"))
            self.rows[i] = None
        else:
            row.next_token = token

    def fail_running(self) -> None:
        with self.wakeup:
            for i, row in enumerate(self.rows):
                if row is not None:
                    row.request.emit(Output(finish="error"))
                    self.rows[i] = None
