"""One way to time a call, for every measurement the package makes at load (the CPU's kernels, the GPU's int8
products)."""

import statistics
import time
from typing import Callable, Optional

import torch


def timed(call: Callable[[], object], device: Optional[torch.device] = None) -> float:
    """Seconds `call()` takes; on a CUDA `device`, until the GPU has finished what it queued."""
    on_cuda = device is not None and device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if on_cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median_seconds(call: Callable[[], object], repeats: int, device: Optional[torch.device] = None) -> float:
    """The median of `repeats` timed calls (`timed`), after one untimed call that warms it up."""
    call()
    return statistics.median(timed(call, device) for _ in range(repeats))
