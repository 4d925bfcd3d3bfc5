"""Weight-only quantization, the math: the linear layers' weights and the output head stored as int8 or int4;
activations, norms, the embedding table and the KV cache keep the model's dtype. The layers that run the quantized
weights on PyTorch's weight-only kernels are the runtime's (`llama.runtime.quantized`); this module imports none of
them, so that checkpoint and conversion code can quantize without them.

- int8: one scale per output channel, w ~= q * scale with q in [-127, 127].
- int4: groups of `group_size` weights along the input dimension, each with a scale and a zero point,
  w ~= (q - 8) * scale + zero with q in [0, 15] (the convention of `torch.ops.aten._weight_int4pack_mm*`).

Scales never depend on how a weight is split over model-parallel processes: an int8 row split along its input
(wo, w2) takes the largest magnitude of the whole row (an all-reduce over the group), and int4 groups never
straddle a split. So 1 and N processes quantize every weight identically.

The same values can be written once, as a quantized checkpoint (`python -m llama.convert quantize`; its layout is
`llama.checkpoint.quantized`'s), and loaded as stored. `llama.runtime.quantize_model` quantizes a model built as
Meta's code builds it.
"""

from typing import Optional, Tuple

import torch
from torch import nn

SCHEMES = ("int8", "int4")  # the weight-only schemes, which quantized checkpoints store
DEFAULT_GROUP_SIZE = 32  # the most accurate; no slower than larger groups (docs/quantize.md, "Kernels")
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what the int4 kernels accept
INT4_ROWS = 16  # the CPU int4 kernel takes weights of a multiple of this many rows (CUDA: 8)
# Weights are quantized (and int4 converted to the kernel's layout) a block of whole rows at a time, about this
# many values: its float32 temporaries (8 MiB) stay small enough for the allocator to reuse them, where larger
# ones are mapped afresh each time and fault in page by page (figures: docs/speed.md).
CHUNK_VALUES = 2**21


def check_scheme(scheme: str) -> None:
    """A ValueError for a scheme this library does not know."""
    if scheme in ("int8-dyn", "int4-dyn"):
        raise ValueError(f"quantize={scheme!r} (8-bit activations on ONNX Runtime) was removed; use int8 or int4")
    if scheme not in SCHEMES:
        raise ValueError(f"Unknown quantization scheme {scheme!r}; use one of {', '.join(SCHEMES)}")


def check_device(device: torch.device, scheme: str, dtype: torch.dtype) -> None:
    """Raise a ValueError when PyTorch has no kernel for `scheme` on `device` with `dtype` activations."""
    if device.type == "cpu":
        return
    if device.type == "cuda" and (scheme == "int8" or dtype == torch.bfloat16):
        return
    needs = "a CPU, or a CUDA GPU (int4: with dtype bfloat16)"
    raise ValueError(f"quantize={scheme!r} needs {needs}; PyTorch has no such kernel for {device} in {dtype}")


def check_group_size(requested: Optional[int]) -> int:
    """`requested` (None: the default, 32), or a ValueError when the int4 kernels do not take it."""
    requested = requested or DEFAULT_GROUP_SIZE
    if requested not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {requested!r}")
    return requested


def int4_group_size(in_features: int, requested: Optional[int] = None) -> Optional[int]:
    """The int4 group size for a layer with `in_features` inputs: `requested` (default 32) if it divides them,
    else the largest smaller size the kernels accept that does; None when none does."""
    requested = check_group_size(requested)
    for size in INT4_GROUP_SIZES:
        if size <= requested and in_features % size == 0:
            return size
    return None


def chunk_rows(cols: int) -> int:
    """Rows per block for a weight of `cols` inputs: about CHUNK_VALUES values, a multiple of 64 rows (so that int4
    blocks converted one at a time give the bytes the whole weight would)."""
    return max(64, CHUNK_VALUES // cols // 64 * 64)


def row_chunks(weight: torch.Tensor):
    """(rows, block) for blocks of `weight`'s rows, each a float32 copy of its own that the caller may overwrite."""
    step = chunk_rows(weight.shape[1])
    for start in range(0, weight.shape[0], step):
        rows = slice(start, start + step)
        yield rows, weight[rows].to(torch.float32, copy=True)


def row_absmax(weight: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in each row of a 2-D weight, in float32."""
    absmax = []
    for block in weight.split(chunk_rows(weight.shape[1])):
        absmax.append(torch.maximum(-block.amin(dim=1), block.amax(dim=1)).float())  # exact, and no temporary
    return torch.cat(absmax)


@torch.no_grad()  # a weight that requires grad (Meta's model as built) must not keep each block's copy for autograd
def quantize_int8(weight: torch.Tensor, dtype: torch.dtype, absmax: Optional[torch.Tensor] = None):
    """(q int8, scales in `dtype`) of a 2-D weight, one scale per row. `absmax` overrides each row's largest
    magnitude (the whole row's, for a slice of it)."""
    if absmax is None:
        absmax = row_absmax(weight)
    scales = (absmax.float() / 127).to(dtype)  # rounded to the kernel's dtype before q is chosen
    safe = torch.where(scales > 0, scales.float(), 1.0)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for rows, chunk in row_chunks(weight):
        q[rows] = chunk.div_(safe[rows, None]).round_().clamp_(-127, 127)  # in place: no more float temporaries
    return q, scales


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values in [0, 15], two per byte: the even inputs in the low nibble."""
    return q[:, ::2] | q[:, 1::2] << 4


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group_size: int, dtype: torch.dtype):
    """(q, scales, zeros) of a 2-D weight, in groups of `group_size` along each row: q holds values in [0, 15], two
    per byte (`pack_nibbles`); scales and zeros have one column per group, in `dtype`."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, cols // group_size, dtype=dtype, device=weight.device)
    zeros = torch.empty_like(scales)
    for rows_here, chunk in row_chunks(weight):
        groups = chunk.view(chunk.shape[0], -1, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # faster than aminmax over a short last dim
        scale = ((high - low) / 15).to(dtype)
        zero = (low + 8 * scale.float()).to(dtype)  # the value of q = 8
        safe = torch.where(scale > 0, scale.float(), 1.0)
        levels = groups.sub_(zero.float()[..., None]).div_(safe[..., None]).round_().add_(8).clamp_(0, 15)
        q[rows_here] = pack_nibbles(levels.to(torch.uint8).view(chunk.shape))
        scales[rows_here], zeros[rows_here] = scale, zero
    return q, scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 weight that a quantized one (from `quantize_int8`, or with `zeros` `quantize_int4`) stands for."""
    if zeros is None:
        return q.float() * scales.float()[:, None]
    rows, groups = scales.shape
    q = unpack_nibbles(q).view(rows, groups, -1)  # a group's values along the last dimension
    return ((q.float() - 8) * scales.float()[..., None] + zeros.float()[..., None]).view(rows, -1)


def int4_group_for(
    rows: int, cols: int, group_size: Optional[int], row_parallel: bool = False, mp_size: int = 1
) -> Optional[int]:
    """The int4 group size of a `rows` x `cols` weight (its whole shape, so the same on any number of processes),
    or None when int4 cannot hold it and it is quantized to int8.

    Raises:
        ValueError: when splitting the weight over `mp_size` processes would cut its groups.
    """
    size = int4_group_size(cols, group_size) if rows % INT4_ROWS == 0 else None
    local_rows, local_cols = (rows, cols // mp_size) if row_parallel else (rows // mp_size, cols)
    if size is not None and (local_cols % size or local_rows % INT4_ROWS):
        raise ValueError(
            f"A {rows} x {cols} weight split over {mp_size} processes cuts its int4 groups of {size} inputs or "
            f"{INT4_ROWS} outputs; use fewer processes or a smaller group_size"
        )
    return size


def whole_shape(layer: nn.Module) -> Tuple[int, int]:
    """(out_features, in_features) of a fairscale linear layer's whole weight, whatever slice this process holds."""
    return layer.out_features, layer.in_features
