"""Weight-only quantization: the linear layers' weights and the output head stored as int8 or int4, run on
PyTorch's own weight-only kernels; activations, norms, the embedding table and the KV cache keep the model's dtype.

- int8: one scale per output channel, w ~= q * scale with q in [-127, 127].
- int4: groups of `group_size` weights along the input dimension, each with a scale and a zero point,
  w ~= (q - 8) * scale + zero with q in [0, 15] (the convention of `torch.ops.aten._weight_int4pack_mm*`).

Scales never depend on how a weight is split over model-parallel processes: an int8 row split along its input
(wo, w2) takes the largest magnitude of the whole row (an all-reduce over the group), and int4 groups never
straddle a split. So 1 and N processes quantize every weight identically.
"""

from typing import Optional

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

from llama.parallel_layers import ParallelLinear, replace_layers

SCHEMES = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32  # the most accurate; no slower than larger groups (docs/quantize.md)
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what the int4 kernels accept
INT4_ROWS = 16  # the CPU int4 kernel takes weights of a multiple of this many rows (CUDA: 8)
ROWS_PER_CHUNK = 4096  # weights are quantized this many rows at a time, to bound the float temporaries


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"Unknown quantization scheme {scheme!r}; use one of {', '.join(SCHEMES)} (or None)")


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


def row_chunks(weight: torch.Tensor):
    for start in range(0, weight.shape[0], ROWS_PER_CHUNK):
        yield weight[start : start + ROWS_PER_CHUNK].float()


def row_absmax(weight: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in each row of a 2-D weight, in float32."""
    return torch.cat([chunk.abs().amax(dim=1) for chunk in row_chunks(weight)])


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype, absmax: Optional[torch.Tensor] = None):
    """(q int8, scales in `dtype`) of a 2-D weight, one scale per row. `absmax` overrides each row's largest
    magnitude (the whole row's, for a slice of it)."""
    if absmax is None:
        absmax = row_absmax(weight)
    scales = (absmax.float() / 127).to(dtype)  # rounded to the kernel's dtype before q is chosen
    safe = torch.where(scales > 0, scales.float(), 1.0)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    for start, chunk in zip(range(0, weight.shape[0], ROWS_PER_CHUNK), row_chunks(weight)):
        rows = slice(start, start + chunk.shape[0])
        q[rows] = torch.round(chunk / safe[rows, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int, dtype: torch.dtype):
    """(q uint8 in [0, 15], scales, zeros) of a 2-D weight, in groups of `group_size` along each row; scales
    and zeros have one column per group, in `dtype`."""
    rows, cols = weight.shape
    q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, cols // group_size, dtype=dtype, device=weight.device)
    zeros = torch.empty_like(scales)
    for start, chunk in zip(range(0, rows, ROWS_PER_CHUNK), row_chunks(weight)):
        rows_here = slice(start, start + chunk.shape[0])
        groups = chunk.view(chunk.shape[0], -1, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).to(dtype)
        zero = (low + 8 * scale.float()).to(dtype)  # the value of q = 8
        safe = torch.where(scale > 0, scale.float(), 1.0)
        levels = torch.round((groups - zero.float()[..., None]) / safe[..., None]) + 8
        q[rows_here] = levels.clamp(0, 15).to(torch.uint8).view(chunk.shape)
        scales[rows_here], zeros[rows_here] = scale, zero
    return q, scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 weight that a quantized one stands for."""
    if zeros is None:
        return q.float() * scales.float()[:, None]
    group_size = q.shape[1] // scales.shape[1]
    expand = lambda t: t.float().repeat_interleave(group_size, dim=1)  # noqa: E731
    return (q.float() - 8) * expand(scales) + expand(zeros)


def max_over_model_parallel_group(x: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of `x` over the model-parallel group (`x` itself in one process)."""
    if fs_init.get_model_parallel_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=fs_init.get_model_parallel_group())
    return x


class QuantizedLinear(ParallelLinear):
    def unpack(self) -> nn.Module:
        raise ValueError("A quantized layer has no fairscale form: its weight is no longer in floating point")


class Int8Linear(QuantizedLinear):
    """A fairscale linear layer with an int8 weight (`weight`, `scales`) in place of its float one."""

    def __init__(self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor):
        super().__init__(layer)
        del self.weight
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # dequantize inside the product; torch.compile fuses the two
            return F.linear(x, self.weight.to(x.dtype)) * self.scales
        rows = x.reshape(-1, x.shape[-1])
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales).view(*x.shape[:-1], -1)


class Int4Linear(QuantizedLinear):
    """A fairscale linear layer with an int4 weight, held in the layout of PyTorch's int4 kernel for its device
    (`weight`, `scales_and_zeros`): a runtime form, not a file format (docs/quantize.md)."""

    def __init__(self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        super().__init__(layer)
        del self.weight
        self.group_size = q.shape[1] // scales.shape[1]
        if q.device.type == "cpu":
            # Packed a block of rows at a time (the same bytes as all at once), to bound the int32 temporary.
            blocks = q.split(ROWS_PER_CHUNK)
            packed = torch.cat(
                [torch.ops.aten._convert_weight_to_int4pack_for_cpu(b.to(torch.int32), 2) for b in blocks]
            )
        else:
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # the CUDA kernel's nibble order
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
        self.register_buffer("weight", packed)
        # (groups, out_features, 2): each group's scale and zero, for every output channel
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).contiguous())
        self.out_features = q.shape[0]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        scales_and_zeros = self.scales_and_zeros.to(x.dtype)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group_size, scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)


def quantize_layer(layer: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """A quantized copy of one fairscale linear layer (or `ParallelLinear`), this process's slice of it."""
    if isinstance(layer, ParallelLinear):
        layer = layer.unpack()  # the fairscale layer, given its weight back
    weight = layer.weight
    row_parallel = isinstance(layer, RowParallelLinear)
    mp_size = fs_init.get_model_parallel_world_size()
    if scheme == "int4":
        # Decided from the whole weight's shape, so that it is the same on any number of processes.
        rows, cols = (
            weight.shape[0] * (1 if row_parallel else mp_size),
            weight.shape[1] * (mp_size if row_parallel else 1),
        )
        size = int4_group_size(cols, group_size) if rows % INT4_ROWS == 0 else None
        if size is not None and (weight.shape[1] % size or weight.shape[0] % INT4_ROWS):
            raise ValueError(
                f"A {rows} x {cols} weight split over {mp_size} processes cuts its int4 groups of {size} inputs or "
                f"{INT4_ROWS} outputs; use fewer processes or a smaller group_size"
            )
        if size is not None:
            return Int4Linear(layer, *quantize_int4(weight, size, weight.dtype))
    absmax = None
    if row_parallel:  # the whole row's largest magnitude, not this slice's
        absmax = max_over_model_parallel_group(row_absmax(weight))
    return Int8Linear(layer, *quantize_int8(weight, weight.dtype, absmax))


def quantize_model(model: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """Quantize every linear layer of a `Transformer` and its output head, in place; return the model.

    Works on a model built as Meta's code builds it (fairscale's layers, weights loaded) and on `Llama.build`'s.
    With several model-parallel processes, call it in all of them: each quantizes its own slice.

    Args:
        model: The Transformer, with its weights.
        scheme: "int8" (one scale per output channel) or "int4" (groups along the input).
        group_size: int4's group size, one of 256, 128, 64 or 32 (default). A layer whose input width it does not
            divide takes the largest smaller size that does; a layer that int4 cannot hold (an input width that is
            not a multiple of 32, or outputs not a multiple of 16) is quantized to int8 instead.

    Raises:
        ValueError: for an unknown scheme or group size, or a device PyTorch has no kernel for.
    """
    check_scheme(scheme)
    if scheme == "int4":
        check_group_size(group_size)
    weight = model.tok_embeddings.weight
    check_device(weight.device, scheme, weight.dtype)
    replace_layers(
        model,
        (ColumnParallelLinear, RowParallelLinear, ParallelLinear),
        lambda layer: layer if is_quantized(layer) else quantize_layer(layer, scheme, group_size),
    )
    return model


def is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, QuantizedLinear)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized layers' tensors (quantized values, scales and zeros) in `model`."""
    return sum(t.numel() * t.element_size() for m in model.modules() if is_quantized(m) for t in m.buffers())
