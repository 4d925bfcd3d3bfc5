"""The timers of every measurement the runtime makes at load: one call (`timed`, `median_seconds`), the kernels of
many products in interleaved rounds on the CPU (`time_kernels`: the float kernels and the int8 products), and a
product as the GPU runs it inside a CUDA graph (`gpu_seconds`)."""

import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from llama.runtime.cuda_graphs import record

T = TypeVar("T")
TIMED_ROUNDS = 5  # the CPU's timed rounds of each kernel, after a warm-up one
GRAPH_CALLS = 10  # calls per timed CUDA graph replay


def timed_call(call: Callable[[], T], device: Optional[torch.device] = None) -> Tuple[T, float]:
    """What `call()` returns, and the seconds it takes; on a CUDA `device`, until the GPU has finished what it
    queued."""
    on_cuda = device is not None and device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = call()
    if on_cuda:
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def timed(call: Callable[[], object], device: Optional[torch.device] = None) -> float:
    """The seconds `call()` takes (`timed_call`)."""
    return timed_call(call, device)[1]


def median_seconds(call: Callable[[], object], repeats: int, device: Optional[torch.device] = None) -> float:
    """The median of `repeats` timed calls (`timed`), after one untimed call that warms it up."""
    call()
    return statistics.median(timed(call, device) for _ in range(repeats))


def time_kernels(
    runs: List[Dict[str, Callable[[], object]]],
    flush: Optional[Callable[[], object]],
    rounds: int = TIMED_ROUNDS,
    warm: Optional[List[Dict[str, Callable[[], object]]]] = None,
) -> List[Dict[str, List[float]]]:
    """For each product (a dict of its kernels' calls), each kernel's time in seconds in each of `rounds` rounds,
    after a warm-up round (where oneDNN builds its primitives and mapped weights are read in). Within a round every
    product's kernels take turns, so that a slow spell of a shared machine falls on all of them. Each round starts
    with `flush` (if any), which evicts the caches, since in a decode step each weight comes from memory, the rest
    of the model having been read since; every kernel of every product runs on weights of its own, so no call brings
    the next one's weights into the cache, and one flush serves the whole round. `warm` (for each product, a call of
    some of its kernels, on weights of their own) runs, untimed, right before each of those kernels' timed calls. A
    kernel more than twice as slow as its product's best after a round is not timed again."""
    for product in runs:
        for run in product.values():
            run()
    found = [{kernel: [] for kernel in product} for product in runs]
    still_timed = [list(product) for product in runs]
    for _ in range(rounds):
        if flush is not None:
            flush()
        for product, times, kernels, before in zip(runs, found, still_timed, warm or [{}] * len(runs)):
            for kernel in kernels:
                if kernel in before:
                    before[kernel]()
                times[kernel].append(timed(product[kernel]))
        for times, kernels in zip(found, still_timed):
            best = {kernel: min(seconds) for kernel, seconds in times.items()}
            kernels[:] = [kernel for kernel in kernels if best[kernel] <= 2 * min(best.values())]
    return found


def graph_seconds_or_first(call: Callable[[], object], first: float, repeats: int) -> float:
    """`gpu_seconds`, or for a product that cannot be recorded as a CUDA graph, its first call's time."""
    try:
        return gpu_seconds(call, repeats)
    except RuntimeError:
        return first


def gpu_seconds(call: Callable[[], object], repeats: int) -> float:
    """Seconds per `call()`, as the GPU runs it: `GRAPH_CALLS` calls recorded as one CUDA graph (so that Python's
    time to launch them is left out, as in a recorded decode step), the median of `repeats` replays."""
    graph, _ = record(lambda: [call() for _ in range(GRAPH_CALLS)], None)
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000 / GRAPH_CALLS)
    return statistics.median(seconds)
