"""The CPU's products of a quantized weight for a prompt's rows: the weight widened to floating point a block of
output rows at a time (`chunk_rows`), each block multiplied by the CPU's matrix kernels (oneDNN's in bfloat16, MKL's
in float32). PyTorch's int8 and int4 kernels for the CPU are made for a few rows; on many rows these are faster, and
no second copy of the weight is held (docs/speed.md, "The kernel table", has the figures).

Each block is widened into a buffer of this thread's (`scratch`), reused by every block and every call: memory
mapped afresh at each call is faulted in page by page, which cost a small weight's product at 64 rows half again
its time.
"""

import functools
import math
import threading
from typing import Optional, Tuple

import torch

from llama.quantize import chunk_rows

_buffers = threading.local()


def scratch(name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer `name` of `dtype`, viewed as `shape`: made (or grown) at its first use, then reused. Its
    values are whatever the last user left. Made outside inference mode, so that every later call may write it."""
    buffers = _buffers.__dict__.setdefault("by_name", {})
    size = math.prod(shape)
    buffer = buffers.get((name, dtype))
    if buffer is None or buffer.numel() < size:
        with torch.inference_mode(False):
            buffer = buffers[(name, dtype)] = torch.empty(size, dtype=dtype)
    return buffer[:size].view(shape)


# Below this many rows a block's product runs with the block on the left, W x^T: the matrix kernel then packs the
# few rows into its own layout, not the block, and reads the block as it lies; from it on, x W^T (the prompt of 64
# tokens 1.10x faster on a Zen 5 at 1B in int8, docs/speed.md; the two orders even from some 128 rows on).
LEFT_BELOW_ROWS = 128


class BlockProducts:
    """The output of a widened product (`rows` x `out_features`, in `rows`' dtype), written a block of at most
    `width` outputs at a time (`put`): below `LEFT_BELOW_ROWS` rows by W x^T into a block of its own, then copied
    transposed into the output while it is in the cache (a transpose of the whole output at the end took 2.6 ms at
    512 x 8192); from it on by x W^T into the output as it lies."""

    def __init__(self, rows: torch.Tensor, out_features: int, width: int):
        self.rows = rows
        self.y = torch.empty(len(rows), out_features, dtype=rows.dtype)
        left = len(rows) < LEFT_BELOW_ROWS
        self.block = torch.empty(width, len(rows), dtype=rows.dtype) if left else None

    def put(self, weight: torch.Tensor, start: int) -> None:
        """The product of the rows and `weight`, a block of outputs from `start`."""
        out = self.y[:, start : start + len(weight)]
        if self.block is None:
            torch.matmul(self.rows, weight.t(), out=out)
        else:
            block = self.block[: len(weight)]
            torch.matmul(weight, self.rows.t(), out=block)
            out.copy_(block.t())

    def result(self, scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The product, rows by outputs, each output scaled by `scales` if given."""
        return self.y if scales is None else self.y.mul_(scales)


def widened_in_blocks(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """The product of `x` and an int8 weight (`q`, one scale per output row), the weight widened to `dtype` (`x`'s
    if None) a block at a time (`BlockProducts`): in float32 that is MKL's product, several times faster on a
    prompt's rows than bfloat16's where the CPU has no bfloat16 matrix kernels (AVX2)."""
    dtype = dtype or x.dtype
    step = chunk_rows(q.shape[1])
    widest = min(step, q.shape[0])
    products = BlockProducts(x.reshape(-1, x.shape[-1]).to(dtype), q.shape[0], widest)
    buffer = scratch("int8 widened", (widest, q.shape[1]), dtype)
    for start in range(0, q.shape[0], step):
        block = q[start : start + step]
        products.put(buffer[: len(block)].copy_(block), start)
    return products.result(scales.to(dtype)).to(x.dtype).view(*x.shape[:-1], -1)


@functools.cache
def cpu_int4_block_rows() -> Optional[int]:
    """The rows per block of the layout `_convert_weight_to_int4pack_for_cpu` makes here, or None where it is none of
    those `unpack_cpu_int4` reads. The layout is PyTorch's own and depends on the CPU's instructions (wider blocks
    with AVX-512), so it is found by packing a random weight and reading it back."""
    levels = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 2)
    return next((rows for rows in (64, 32, 16) if torch.equal(unpack_cpu_int4(packed, rows).int(), levels)), None)


def unpack_cpu_int4(packed: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The int4 levels (uint8, out x in) of rows of the CPU kernel's layout, blocks of `block_rows` rows: each block
    holds, for each input in turn, the block's first half of rows in low nibbles and its second half in high ones."""
    blocks = packed.view(-1, packed.shape[1] * 2, block_rows // 2)  # (blocks, inputs, half a block's rows)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).transpose(1, 2).reshape(-1, packed.shape[1] * 2)


def widened_int4_in_blocks(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The product of `x` and an int4 weight in the CPU kernel's layout, the weight dequantized in float32 (as
    `dequantize` computes it) a block at a time, rounded to `dtype` (`x`'s if None) (`BlockProducts`): in float32
    MKL's product (fast on AVX2), in bfloat16 oneDNN's (fast where the CPU
    multiplies bfloat16: AVX-512 with bfloat16, AMX).

    The block is unpacked outputs by inputs, as `F.linear` takes a weight: the layout holds it inputs by outputs, so
    its bytes are transposed first (a byte a pair of values, the cheapest place to do it). Laid out so, each core
    writes the outputs it then multiplies; laid inputs by outputs, the product of a freshly dequantized block read
    the other core's writes and sometimes took twice as long (docs/speed.md, "The figures behind constants")."""
    dtype = dtype or x.dtype
    block_rows = cpu_int4_block_rows()
    half = block_rows // 2
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    step = max(block_rows, chunk_rows(in_features) // block_rows * block_rows)
    widest = min(step, out_features)
    products = BlockProducts(x.reshape(-1, x.shape[-1]).to(dtype), out_features, widest)
    nibbles = scratch("int4 nibbles", (widest // block_rows, half, in_features), torch.uint8)
    buffer = scratch("int4 dequantized", (widest, in_features), torch.float32)
    rounded = buffer if dtype == torch.float32 else scratch("int4 rounded", (widest, in_features), dtype)
    for start in range(0, out_features, step):
        tiles = packed[start : start + step].view(-1, in_features, half)  # (blocks, inputs, half a block's rows)
        count = len(tiles)
        width = count * block_rows
        flipped = nibbles[:count].copy_(tiles.transpose(1, 2))
        # Each level q as q ^ 8, whose 4 bits read as a signed number are q - 8, signed by shifting in int8.
        flipped ^= 0x88
        levels = buffer[:width].view(count, 2, half, in_features)  # the low nibbles' rows, then the high ones'
        levels[:, 0].copy_((flipped << 4).view(torch.int8) >> 4)
        levels[:, 1].copy_(flipped.view(torch.int8) >> 4)
        # (outputs, groups, 1) each, contiguous: one operand broadcast along the group keeps the loops vectorized
        scale, zero = (scales_and_zeros[:, start : start + width, i].t().float()[..., None] for i in (0, 1))
        buffer[:width].view(width, -1, group_size).mul_(scale).add_(zero)
        weight = buffer[:width] if rounded is buffer else rounded[:width].copy_(buffer[:width])
        products.put(weight, start)
    return products.result().to(x.dtype).view(*x.shape[:-1], out_features)
