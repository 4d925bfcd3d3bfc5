"""Which kernel runs each product, measured at load (`choose_kernels`; what measuring found is kept in a
`KernelCache`), and what decides whether this CPU's kernels apply to a model at all."""

import dataclasses
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from llama.distributed import free_memory
from llama.runtime.cpu.cache import KernelCache, Measured, last_level_cache_bytes
from llama.runtime.cpu.copies import declined_copy, repaid_copies
from llama.runtime.cpu.kernels import (
    KERNEL_VARIABLE,
    KERNELS,
    candidate_kernels,
    fp16_linear,
    holds_bfloat16_values,
    onednn_supported,
    pinned_kernel,
    run_kernel,
    weight_copy,
)
from llama.runtime.cpu.layers import CPULinear, product_name, products, runs_on_a_copy
from llama.runtime.timing import TIMED_ROUNDS, time_kernels, timed_call

logger = logging.getLogger(__name__)

PROMPT_ROWS = 256  # the row count a prompt is measured at; inputs of more rows than the batch use its choice
# One row and the batch: timed on up to this many weights of a product (from memory). A decode step streams weights
# of up to tens of MB each; on a smaller sample the kernels rank as they do not in decoding (docs/speed.md).
DECODE_SAMPLE_VALUES = 2**24
PROMPT_SAMPLE_VALUES = 2**20  # a prompt: fewer, since it is bound by arithmetic rather than by reading the weight
# Each kernel ranks by its median round (`TIMED_ROUNDS` of them), what decoding meets step after step, rather than
# by a lucky fastest one (docs/speed.md); a float16 copy must lead the other kernels' fastest round.
PROMPT_TIMED_ROUNDS = 2  # a prompt's calls are steadier, and each costs some 20 decode calls
# The rounds disagree when a kernel's fastest round beats the best median round by more than this many times: the
# machine was busy (another program took the cores for part of the measurement), and may have decided the choice.
# Such timings are taken once more, and if they still disagree, cached all the same with a warning, for the next
# process's first load to re-check (docs/speed.md, "A busy machine").
NOISE = 1.3
# At a load that finds its timings cached, the kernels of the largest one-row product are timed again (this many
# rounds): if another now leads the cached choice, or the choice runs this many times faster than the cache says,
# the cache was measured on a busier machine, and every product is measured again.
RECHECK_ROUNDS = 3
STALE = 1.5
FLIPPED = 1.2  # by more than this: closer than that, either kernel serves


def row_counts(max_batch_size: int, verify_rows: Optional[int] = None) -> List[int]:
    """The row counts kernels are chosen for: one row (a decode step of one sequence), the batch, the most rows a
    speculative pass checks (`verify_rows`, where decoding speculates), a prompt."""
    between = {count for count in (max_batch_size, verify_rows) if count is not None and 1 < count < PROMPT_ROWS}
    return [1, *sorted(between), PROMPT_ROWS]


def weight_sample(layers: List[CPULinear], max_values: int, part: int = 0) -> Optional[List[torch.Tensor]]:
    """Each layer's weight, or where the product holds more than `max_values` weights, rows of it in proportion:
    the `part`-th such share of its rows (0: the first rows), or None where the weights have no such part."""
    total = sum(layer.weight.numel() for layer in layers)
    if total <= max_values:
        return [layer.weight.detach() for layer in layers] if part == 0 else None
    shares = [max(1, layer.weight.shape[0] * max_values // total) for layer in layers]
    if any((part + 1) * share > layer.weight.shape[0] for share, layer in zip(shares, layers)):
        return None
    return [layer.weight.detach()[part * share : (part + 1) * share] for share, layer in zip(shares, layers)]


def sample_copy(kernel: str, layers: List[CPULinear], max_values: int) -> Optional[List[torch.Tensor]]:
    """The weights `kernel` runs on in a measurement, in memory of its own (see `time_kernels`): the stacked float16
    copy of the sample for "fp16" (None where float16 cannot hold it), a copy in oneDNN's layout for "onednn" in
    bfloat16 (stacked where the layers share one: `FusedProduct`); else a share of the weights' rows that no other
    kernel reads (`weight_sample`), or a copy of the sample where the weights have no such share."""
    weights = weight_sample(layers, max_values)
    if kernel == "fp16":
        copy = weight_copy("fp16", *weights)
        return None if copy is None else [copy]
    if kernel == "onednn" and weights[0].dtype != torch.float32:
        # One product of the stacked weights where the layers share a copy, as they run; else one per layer.
        groups = [weights] if len(layers) > 1 else [[weight] for weight in weights]
        return [weight_copy("onednn", *group) for group in groups]
    return weight_sample(layers, max_values, KERNELS.index(kernel)) or [weight.clone() for weight in weights]


class CacheFlush:
    """Called before each round: reads a buffer the size of the last-level cache that no sample shares, allocated at
    its first call. (Reading the model's weights instead would bring `F.linear`'s and `torch.mv`'s samples, rows of
    those weights, into the cache wherever the model is smaller than it.)"""

    def __init__(self):
        self.buffer = None

    def __call__(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.ones(last_level_cache_bytes() // 4)
        return self.buffer.sum()


@dataclass
class Job:
    """One product at one row count, to be measured."""

    name: str
    layers: List[CPULinear]
    rows: int
    candidates: List[str]
    key: str

    @property
    def sample_values(self) -> int:
        return DECODE_SAMPLE_VALUES if self.rows < PROMPT_ROWS else PROMPT_SAMPLE_VALUES


def make_samples(jobs: List[Job]) -> Dict[tuple, tuple]:
    """Each (product, kernel, sample size)'s weights for measuring (`sample_copy`) with the seconds it took to make,
    made once for all of a product's row counts, on as many threads as torch uses (fbgemm packs on one core)."""
    wanted = {(job.name, kernel, job.sample_values): job.layers for job in jobs for kernel in job.candidates}

    def make(item):
        (_, kernel, values), layers = item
        return timed_call(lambda: sample_copy(kernel, layers, values))

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        return dict(zip(wanted, pool.map(make, wanted.items())))


def measure(jobs: List[Job], flush: Callable[[], object], rounds: int = TIMED_ROUNDS) -> Dict[str, Measured]:
    """What each job's candidate kernels take (`time_kernels`, in up to `rounds` rounds) on a sample of its
    product's weights (`weight_sample`), each kernel on weights in memory of its own (`sample_copy`), keyed by the
    job's key. The jobs of a row count are timed together; one row and the batch with the caches flushed before
    each round (as a decode step meets its weights), a prompt, bound by arithmetic, without. Rounds that disagree
    (`disagree`) are timed once more, and marked `noisy` if they still do."""
    samples = make_samples(jobs)
    found = {}
    for rows in sorted({job.rows for job in jobs}):
        group = [job for job in jobs if job.rows == rows]
        inputs = {}  # one random input per width, as the kernels of a product read the same one
        for job in group:
            width = job.layers[0].weight.shape[1]
            if width not in inputs:
                x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
                inputs[width] = x.to(job.layers[0].weight.dtype)
        runs = [kernel_calls(job, samples, inputs[job.layers[0].weight.shape[1]]) for job in group]
        decode = rows < PROMPT_ROWS
        rounds = min(rounds, TIMED_ROUNDS if decode else PROMPT_TIMED_ROUNDS)
        timings = time_kernels(runs, flush if decode else None, rounds)
        if any(map(disagree, timings)):  # a busy spell: it rarely lasts through a second measurement
            timings = time_kernels(runs, flush if decode else None, rounds)
        for job, seconds in zip(group, timings):
            values = sum(weight.numel() for weight in weight_sample(job.layers, job.sample_values))
            copy = samples.get((job.name, "fp16", job.sample_values), (None, 0.0))
            found[job.key] = Measured(
                {kernel: min(times) / values for kernel, times in seconds.items()},
                {kernel: statistics.median(times) / values for kernel, times in seconds.items()},
                copy[1] / values / torch.get_num_threads() if copy[0] is not None else None,
                noisy=disagree(seconds),
            )
    return found


def disagree(times: Dict[str, List[float]]) -> bool:
    """Whether noise may have decided a product's choice: some kernel's fastest round beat the usual (median) round
    of the kernel with the best median by more than `NOISE` times, as when another program slowed that kernel in
    most rounds. A near tie, or steady rounds, are not noise that matters."""
    usual = min(statistics.median(rounds) for rounds in times.values())
    return any(NOISE * min(rounds) < usual for rounds in times.values())


def kernel_calls(job: Job, samples: Dict[tuple, tuple], x: torch.Tensor) -> Dict[str, Callable[[], object]]:
    """A call of each of the job's candidate kernels on `x` and the kernel's own sample of the weights."""
    calls = {}
    for kernel in job.candidates:
        copy = samples[job.name, kernel, job.sample_values][0]
        if kernel == "fp16" and copy is not None:  # one product of the stacked weights, as a fused group runs
            calls[kernel] = lambda packed=copy[0]: fp16_linear(x, packed)
        elif copy is not None:
            calls[kernel] = lambda kernel=kernel, copy=copy: [run_kernel(kernel, x, weight, None) for weight in copy]
    return calls


def kernels_for(measured: Dict[int, Measured], max_seq_len: int) -> Dict[int, str]:
    """The kernel for each row count: the fastest measured, except that a float16 copy is made only where it pays
    (`repaid_copies`): a copy that would speed up only the prompts may take longer to make than it ever saves
    (docs/speed.md, "How the CPU kernels are chosen")."""
    making = max((m.fp16_copy or 0.0 for m in measured.values()), default=0.0)
    return repaid_copies(measured, max_seq_len, "fp16", making, counts_below_a_prompt(measured))


def counts_below_a_prompt(measured: Dict[int, Measured]) -> List[int]:
    """The row counts of `measured` (`row_counts`: one row, the batch, a verification, a prompt) that decode steps
    run: all but the prompt's. (The quantized products' row counts are fixed instead, and which of them decode steps
    run depends on the batch: `llama.runtime.quantized_kernels.decode_counts`.)"""
    return [rows for rows in measured if rows < PROMPT_ROWS]


def on_one_copy(measured: Dict[int, Measured], chosen: Dict[int, str], dtype: torch.dtype) -> Dict[int, str]:
    """`chosen` (row count -> kernel) with its product on one copy of its weights at most: where it would run on
    both the float16 copy and oneDNN's, it keeps the copy of the fewest rows' kernel (a decode step's, as a rule)
    and the row counts that ran on the other take their fastest kernel but that one."""
    on_copies = [chosen[rows] for rows in sorted(chosen) if runs_on_a_copy(chosen[rows], dtype)]
    if len(set(on_copies)) < 2:
        return chosen
    left_out = next(kernel for kernel in on_copies if kernel != on_copies[0])
    return {
        rows: measured[rows].fastest(leave_out=left_out) if kernel == left_out else kernel
        for rows, kernel in chosen.items()
    }


def choose_kernels(model: nn.Module, counts: List[int], copies: int) -> Dict[CPULinear, Dict[int, str]]:
    """Each `CPULinear`'s kernels for `counts` rows (row count -> kernel): pinned by `LLAMA_CPU_KERNEL` (where that
    kernel can run the product: else `F.linear`), or chosen by `kernels_for` from what measuring
    `candidate_kernels` found, from the cache or measured here (all products at once: `measure`), once per product
    name, on as many copies of its weights as `copies` (`copies_that_fit`); each choice is logged."""
    pinned = pinned_kernel()
    cache = KernelCache()
    settled = cache.used_in_this_process()  # chosen by an earlier load of this process: not re-checked
    start = time.perf_counter()
    all_products = products(model)
    by_name = {}
    for layers in all_products:
        by_name.setdefault(product_name(layers), layers)
    chosen, jobs, measured, cached = {}, [], {}, []
    with torch.no_grad():
        for name, layers in by_name.items():
            fp16_holds = all(holds_bfloat16_values(layer.weight) for layer in layers)
            chosen[name] = {}
            for rows in counts:
                candidates = candidate_kernels(layers[0].weight.dtype, rows, fp16_holds, copies > 0)
                key = cache.key(name, rows, candidates)
                if pinned is not None:
                    kernel = pinned if pinned in candidates else "linear"
                    chosen[name][rows] = kernel, f"pinned by {KERNEL_VARIABLE}={pinned}"
                elif len(candidates) == 1:
                    chosen[name][rows] = candidates[0], "the only candidate"
                elif (hit := cache.get(key)) is not None:
                    measured[name, rows] = hit, f"from {cache.path}"
                    cached.append(Job(name, layers, rows, candidates, key))
                else:
                    jobs.append(Job(name, layers, rows, candidates, key))
        if jobs or cached:
            flush = CacheFlush()
            unchecked = [job for job in cached if job.key not in settled]
            if unchecked and cached_timings_stale(unchecked, measured, flush, cache):
                cache.forget([job.key for job in cached])
                jobs += cached
            if jobs:
                found = measure(jobs, flush)
                for job in jobs:
                    cache.put(job.key, found[job.key])
                    measured[job.name, job.rows] = found[job.key], "measured" + (", busy" * found[job.key].noisy)
                warn_if_busy([job for job in jobs if found[job.key].noisy])
            del flush
    every_job = {job.key: job for job in cached + jobs}
    for key in cache.agree(set(every_job)):  # under model parallelism every rank runs what rank 0 measured
        job = every_job[key]
        measured[job.name, job.rows] = cache.get(key), "as rank 0 measured"
    for name, layers in by_name.items():
        timings = {rows: m for (product, rows), (m, _) in measured.items() if product == name}
        fastest = kernels_for(timings, model.params.max_seq_len)
        if copies < 2 and (one := on_one_copy(timings, fastest, layers[0].weight.dtype)) != fastest:
            logger.info(
                "Memory for one copy of the weights only: %s runs on its %s copy alone",
                name,
                next(k for k in one.values() if runs_on_a_copy(k, layers[0].weight.dtype)),
            )
            fastest = one
        for rows, kernel in fastest.items():
            m, how = measured[name, rows]
            figures = ", ".join(f"{k} {t * 1e9:.3g}" for k, t in m.median.items())
            chosen[name][rows] = kernel, f"{how}: {figures} ms per million weights"
        for rows, (kernel, how) in chosen[name].items():
            logger.info("CPU kernel for %s, %d rows: %s (%s)", name, rows, kernel, how)
        weights = sum(layer.weight.numel() for group in all_products for layer in group if product_name(group) == name)
        making = max((m.fp16_copy for m in timings.values() if m.fp16_copy is not None), default=0.0)
        kernels = {rows: kernel for rows, (kernel, _) in chosen[name].items()}
        why = declined_copy(
            timings, kernels, "fp16", making, model.params.max_seq_len, counts_below_a_prompt(timings), weights
        )
        if why:
            logger.info("No float16 copy for %s: %s", name, why)
    cache.save()
    logger.info(
        "CPU kernels chosen for %d products in %.2f s (%d row counts measured)",
        len(chosen),
        time.perf_counter() - start,
        len(jobs),
    )
    return {
        layer: {rows: kernel for rows, (kernel, _) in sorted(chosen[product_name(layers)].items())}
        for layers in all_products
        for layer in layers
    }


def cached_timings_stale(
    cached: List[Job], measured: Dict[tuple, tuple], flush: Callable[[], object], cache: KernelCache
) -> bool:
    """Whether the cached timings of `cached` (their `measured` entries) no longer hold here: the largest one-row
    product's kernels, timed again (`RECHECK_ROUNDS`), put another kernel's usual round `FLIPPED` times ahead of the
    cached choice's fastest, or the cached choice's fastest round was `STALE` times its usual round now, so the
    cache was measured on a busier machine. A re-check on a machine busy now (its own rounds disagree, or the cached
    choice runs `STALE` times slower than the cache says) cannot tell, and keeps the cache; one that finds the
    figures hold marks them `confirmed`, and later loads re-check no more. Only a process's first use of an entry
    is re-checked: every load of one process chooses alike."""
    one_row = [job for job in cached if job.rows == 1 and len(measured[job.name, 1][0].median) > 1]
    if not one_row:
        return False
    job = max(one_row, key=lambda job: sum(layer.weight.numel() for layer in job.layers))
    before = measured[job.name, 1][0]
    if before.confirmed:
        return False
    now = measure([job], flush, RECHECK_ROUNDS)[job.key]
    choice, fastest_now = before.fastest(), now.fastest()
    if now.noisy or choice not in now.median or now.seconds[choice] > STALE * before.median[choice]:
        # Busy now (rounds that disagree, or the choice's fastest round slower than its usual cached one, as when
        # another process works beside this one), or the cached choice cannot run: cannot tell.
        return False
    # Each side's own spread counts against it: the choice's fastest round must lose to the other's usual one, and
    # the cached fastest round must be slower than the usual one now (noise alone seldom does either).
    flipped = now.seconds[choice] > FLIPPED * now.median[fastest_now]
    busier = before.seconds[choice] > STALE * now.median[choice]
    if flipped or busier:
        logger.warning(
            "The CPU kernel timings cached in %s were measured on a busier machine (%s, 1 row, ms per million "
            "weights: %s now %.3g, cached %.3g; %s now %.3g): measuring every product again. The kernels may change, "
            "and with them the last digits of the results, this once: later loads keep what is measured now",
            cache.path,
            job.name,
            choice,
            now.median[choice] * 1e9,
            before.median[choice] * 1e9,
            fastest_now,
            now.median[fastest_now] * 1e9,
        )
    else:
        cache.put(job.key, dataclasses.replace(before, confirmed=True))
    return flipped or busier


def warn_if_busy(noisy: List[Job]) -> None:
    if noisy:
        logger.warning(
            "The CPU was busy while its kernels were measured (the rounds of %d of them disagreed by more than "
            "%d%% even when timed again): chosen from those figures and cached; the next process's first load "
            "re-checks them",
            len(noisy),
            round((NOISE - 1) * 100),
        )


def runs_on_cpu_kernels(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can run on the kernels measured here (`CPULinear`): on the CPU, in float32 or
    bfloat16, with a torch build that has oneDNN."""
    weight = model.norm.weight  # in the model's dtype, on its device (the embedding may be int4)
    return onednn_supported(weight.device) and weight.dtype in (torch.float32, torch.bfloat16)


def copies_that_fit(model: nn.Module) -> int:
    """How many copies of the weights the kernels may run on (fbgemm's float16 one, oneDNN's blocked layout; 2 bytes
    a weight each): as many as fit together in this process's share of half the memory the system has available
    now, 0, 1 or 2. With none, no kernel that runs on a copy is a candidate; with one, each product runs on one copy
    at most (`on_one_copy`). The ranks of one job on this machine (torchrun's `LOCAL_WORLD_SIZE`) share it."""
    copy_bytes = max(1, sum(p.numel() * 2 for p in model.parameters()))
    return min(2, (free_memory(torch.device("cpu")) or 0) // (2 * copy_bytes))
