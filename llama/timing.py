"""One way to time a call, for every measurement the package makes at load (the CPU's kernels, the GPU's int8
products)."""

import statistics
import time
from typing import Callable, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")


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
