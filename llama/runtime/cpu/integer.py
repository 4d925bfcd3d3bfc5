"""An int8 weight's product in integers on the CPU (the "fbgemm_int8" kernel): each row of activations written as two
parts of 7-bit integers, both multiplied by the weight in one call of fbgemm's integer kernel, the two results scaled
and added.

PyTorch's weight-only int8 kernel multiplies in floating point and is bound by that arithmetic on one row (half the
memory's speed or less: docs/speed.md, "The kernel table"). fbgemm multiplies 8-bit activations by 8-bit weights in
integers at memory speed, but rounds each call's activations to 8 bits, far from the weight-only accuracy. Here the
activations are instead written exactly enough as two integer rows: a coarse part, each value rounded to a 63rd of
its row's largest magnitude, and a fine part, what the coarse one leaves rounded to a 126th of that step. What is
lost is at most 1/15,876 of the row's largest magnitude, against bfloat16's own rounding of each value by up to 1/512
of it. Two rows cost one row's time where reading the weight is what takes the time.

Run for 16-bit activations only (`Int8Linear.runs`). Seven bits, not eight: fbgemm's AVX2 kernels add pairs
of products in 16 bits, exact only for activations below 128. Integer sums are exact, so the result does not depend
on the thread count. PyTorch reaches fbgemm only through its quantized tensors, which it has deprecated: only this
module touches them, and where they are gone, where another quantized engine is set, or where the sums are other
than exact, the product is not run (`two_part_product_available`).
"""

import functools
import threading
import warnings
from typing import List

import torch

LEVELS = 63  # each part's largest level: activations in [1, 127] once ZERO_POINT is added
ZERO_POINT = 64
FINE_STEPS = 2 * LEVELS  # the fine part's steps in one coarse step
# Weights per packed piece: fbgemm packs a large weight several times slower per byte than a piece of this size
# (Llama 3.2 1B's head, 128256 x 2048, took 3.4 s whole, 1.1 s in 16 pieces).
PIECE_VALUES = 2**24
# PyTorch warns of its quantized tensors' deprecation as each is made; `warnings.catch_warnings` is not thread-safe,
# and layers are packed on several threads.
_quantized_tensors = threading.Lock()


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> List[object]:
    """fbgemm's packed copy of an int8 weight (`q`, out x in) and its scales, one per output, in pieces of at most
    `PIECE_VALUES` weights (of whole output rows). Under PyTorch's default quantized engine ("x86"), or "fbgemm"."""
    step = max(1, PIECE_VALUES // q.shape[1])
    zero_points = torch.zeros(min(step, len(q)), dtype=torch.long)
    pieces = []
    for block, block_scales in zip(q.split(step), scales.split(step)):
        with _quantized_tensors:  # its deprecation warning silenced, one thread at a time
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                weight = torch._make_per_channel_quantized_tensor(
                    block, block_scales.double(), zero_points[: len(block)], 0
                )
        pieces.append(torch.ops.quantized.linear_prepack(weight, None))
    return pieces


def two_parts(rows: torch.Tensor):
    """(coarse and fine parts stacked, integers in [-LEVELS, LEVELS] held in float32; the coarse parts' step, one per
    row) of `rows` (16-bit or float32): rows == (coarse + fine / FINE_STEPS) * step, to within step / 2 / FINE_STEPS.
    Written with few operations, each into the parts' own memory: on one row their count is what the parts cost."""
    count = len(rows)
    step = rows.abs().amax(-1, keepdim=True).float()  # exact in float32: each row's largest magnitude
    step.clamp_min_(torch.finfo(torch.float32).tiny).div_(LEVELS)
    parts = torch.empty(2 * count, rows.shape[-1])
    levels = torch.div(rows, step, out=parts[count:])  # each value in coarse steps, within [-LEVELS, LEVELS]
    coarse = torch.round(levels, out=parts[:count])
    # What the coarse part leaves, at most half a coarse step, in fine steps: within [-LEVELS, LEVELS].
    levels.sub_(coarse).mul_(FINE_STEPS).round_()
    return parts, step


def integer_sums(levels: torch.Tensor, packed) -> torch.Tensor:
    """fbgemm's product of `levels` (integers in [-LEVELS, LEVELS], held in float32) and one piece of a weight packed
    by `pack_int8`: each output's sum of products in integers, times the output's scale, in float32."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(levels, 1.0, ZERO_POINT, packed)


def two_part_product(x: torch.Tensor, pieces: List[object]) -> torch.Tensor:
    """The product of `x` and a weight packed by `pack_int8`, in `x`'s dtype (see the module's docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    parts, step = two_parts(rows)
    if len(pieces) == 1:
        sums = integer_sums(parts, pieces[0])
    else:
        sums = torch.cat([integer_sums(parts, piece) for piece in pieces], dim=1)
    y = torch.add(sums[: len(rows)], sums[len(rows) :], alpha=1 / FINE_STEPS).mul_(step)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


@functools.cache
def fbgemm_integer_kernel() -> bool:
    """Whether this torch build reaches fbgemm's integer product on this CPU (its quantized ops, the "x86" or
    "fbgemm" engine): the dependency of `two_part_product`."""
    try:
        (packed,) = pack_int8(torch.ones(16, 8, dtype=torch.int8), torch.ones(16))
        integer_sums(torch.ones(1, 8), packed)
    except (AttributeError, RuntimeError):  # no quantized ops in this build, no fbgemm here, or another engine's
        return False
    return True


def exact_integer_sums() -> bool:
    """Whether fbgemm sums the largest levels exactly here: weights of int8's extremes times activations of the
    parts' extremes, against the same sums in float64."""
    q = torch.tensor([[127, 127], [-128, -128], [127, -127], [-128, 127]], dtype=torch.int8).repeat(4, 128)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0]).repeat(len(q) // 4)  # powers of 2: exact products
    levels = torch.tensor([[LEVELS, LEVELS], [-LEVELS, -LEVELS], [LEVELS, -LEVELS]], dtype=torch.float32).repeat(1, 128)
    (packed,) = pack_int8(q, scales)
    sums = integer_sums(levels, packed)
    return torch.equal(sums.double(), (levels.double() @ q.double().t()) * scales.double())


@functools.cache
def two_part_product_available() -> bool:
    """Whether `two_part_product` runs here: fbgemm's integer kernel is present, and its sums are exact."""
    return fbgemm_integer_kernel() and exact_integer_sums()
