"""Which kernel attends one new position (a decode step) in bfloat16 on the CPU: SDPA's, or float32 matmuls rounded
as Meta's bfloat16 attention rounds (`one_position_attention`). SDPA's costs little on a short cache and grows
steeply with its length; the matmuls cost a dozen small operations whatever the length, and grow slowly. Where they
cross depends on the CPU and on the model's heads, so it is measured at load (`attention_kernel`) for the model's
heads at cache lengths of 8 to 2048 positions, and kept in the `KernelCache`: every later load here attends alike,
so gives the same results."""

import functools
import logging
import statistics
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from llama.runtime.cpu.cache import KernelCache, Measured
from llama.runtime.cpu.choice import disagree
from llama.runtime.cpu.kernels import ATTENTION_KERNELS, one_position_attention
from llama.runtime.timing import TIMED_ROUNDS, time_kernels

logger = logging.getLogger(__name__)

LONGEST_TIMED = 2048  # positions: beyond it both kernels' times grow in proportion to the positions
CALLS = 4  # attention calls per timed call, as a step makes one per layer


def timed_positions(max_seq_len: int) -> List[int]:
    """The cache lengths the kernels are timed at: powers of two from 8 to the longest cache (at most
    `LONGEST_TIMED`), and the longest cache where it is shorter than 8."""
    return [2**k for k in range(3, 12) if 2**k <= min(max_seq_len, LONGEST_TIMED)] or [max_seq_len]


def attention_calls(n_heads: int, n_kv_heads: int, head_dim: int, positions: int) -> Dict[str, Callable[[], object]]:
    """A call of each kernel: `CALLS` attentions of one position over `positions` cached ones, random values."""
    generator = torch.Generator().manual_seed(positions)
    xq = torch.randn(1, n_heads, 1, head_dim, generator=generator).bfloat16()
    keys, values = (torch.randn(1, n_kv_heads, positions, head_dim, generator=generator).bfloat16() for _ in "kv")

    def sdpa():
        return [F.scaled_dot_product_attention(xq, keys, values, enable_gqa=n_heads > n_kv_heads) for _ in range(CALLS)]

    def matmul():
        return [one_position_attention(xq, keys, values) for _ in range(CALLS)]

    return dict(zip(ATTENTION_KERNELS, (sdpa, matmul)))


def matmul_attention_from(n_heads: int, n_kv_heads: int, head_dim: int, max_seq_len: int) -> Optional[int]:
    """The fewest cached positions from which the matmuls attend one position faster than SDPA at every timed length
    above too (`timed_positions`, from the cache or timed now), or None where SDPA is faster at the longest."""
    cache = KernelCache()
    name = f"one position's bfloat16 attention, {n_heads} heads, {n_kv_heads} kv heads of {head_dim} values"
    lengths = timed_positions(max_seq_len)
    keys = {positions: cache.key(name, positions, list(ATTENTION_KERNELS)) for positions in lengths}
    measured = {positions: cache.get(key) for positions, key in keys.items()}
    missing = [positions for positions, found in measured.items() if found is None]
    if missing:
        runs = [attention_calls(n_heads, n_kv_heads, head_dim, positions) for positions in missing]
        with torch.no_grad():
            timings = time_kernels(runs, None, TIMED_ROUNDS)
            if any(map(disagree, timings)):  # a busy spell, timed once more as the products are (`measure`)
                timings = time_kernels(runs, None, TIMED_ROUNDS)
        for positions, seconds in zip(missing, timings):
            measured[positions] = Measured(
                {kernel: min(rounds) for kernel, rounds in seconds.items()},
                {kernel: statistics.median(rounds) for kernel, rounds in seconds.items()},
            )
            cache.put(keys[positions], measured[positions])
    changed = cache.agree(set(keys.values()))  # under model parallelism every rank runs what rank 0 measured
    measured.update({positions: cache.get(key) for positions, key in keys.items() if key in changed})
    cache.save()
    start = None
    for positions in reversed(lengths):
        if measured[positions].fastest() != "matmul":
            break
        start = positions
    figures = "; ".join(
        f"{positions}: " + ", ".join(f"{k} {t * 1e6 / CALLS:.0f}" for k, t in measured[positions].median.items())
        for positions in lengths
    )
    chosen = "SDPA at every length" if start is None else f"float32 matmuls from {start} cached positions on"
    logger.info("CPU kernel for %s: %s (us per call by cache length: %s)", name, chosen, figures)
    return start


def attention_kernel(model: nn.Module) -> Optional[Callable]:
    """`one_position_attention` from the cache length where it is measured faster than SDPA, for a bfloat16 model;
    None where SDPA is faster at every length timed, or the model is not in bfloat16."""
    if model.norm.weight.dtype != torch.bfloat16:
        return None
    attention = model.layers[0].attention
    start = matmul_attention_from(
        attention.n_local_heads, attention.n_local_kv_heads, attention.head_dim, model.params.max_seq_len
    )
    return None if start is None else functools.partial(one_position_attention, from_positions=start)
