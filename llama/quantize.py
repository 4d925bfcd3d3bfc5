"""Weight-only quantization: the linear layers' weights and the output head stored as int8 or int4, run on
PyTorch's own weight-only kernels; activations, norms, the embedding table and the KV cache keep the model's dtype.

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

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import RowParallelLinear
from torch import nn

from llama.parallel_layers import ParallelLinear

SCHEMES = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32  # the most accurate; no slower than larger groups (docs/quantize.md)
INT4_GROUP_SIZES = (256, 128, 64, 32)  # what the int4 kernels accept
INT4_ROWS = 16  # the CPU int4 kernel takes weights of a multiple of this many rows (CUDA: 8)
# Weights are quantized (and int4 converted to the kernel's layout) a block of whole rows at a time, about this
# many values: its float32 temporaries (8 MiB) stay small enough for the allocator to reuse them, where larger
# ones are mapped afresh each time and fault in page by page (figures: docs/speed.md).
CHUNK_VALUES = 2**21
# The names of the ways a quantized layer computes its product (`QuantizedLinear.products`), across schemes and
# devices.
QUANTIZED_PRODUCTS = ("int8", "widened", "fused", "tinygemm", "dequantized")


def check_scheme(scheme: str) -> None:
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


# Products on CUDA that torch.compile builds from the widening and the product together (one compiled graph per
# weight shape and row count; `compiled_on_cuda` lets there be many).
CUDA_COMPILE_OPTIONS = {
    # One row times a weight becomes a reduction that reads the weight once, with its block sizes searched: inductor
    # writes it so only with this option on, and the int8 weight is then widened inside it.
    "coordinate_descent_tuning": True,
}
COMPILED_SHAPES = 256  # the compiled graphs one product may hold (torch.compile's default is 8)


def widened_int8_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, q.to(x.dtype)) * scales


def dequantized_int4_weight(nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """`dequantize`'s weight, in `scales`' dtype."""
    return dequantize(nibbles, scales, zeros).to(scales.dtype)


compiled_products = {}


def compiled_on_cuda(fn, *args: torch.Tensor) -> torch.Tensor:
    """`fn(*args)`, compiled by torch.compile for the shapes of `args` (the first call for a shape compiles)."""
    if fn not in compiled_products:
        compiled_products[fn] = torch.compile(fn, dynamic=False, options=CUDA_COMPILE_OPTIONS)
    with torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES):
        return compiled_products[fn](*args)


def max_over_model_parallel_group(x: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of `x` over the model-parallel group (`x` itself in one process)."""
    if fs_init.get_model_parallel_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=fs_init.get_model_parallel_group())
    return x


class QuantizedLinear(ParallelLinear):
    """A linear layer with quantized weights, with one or more ways to compute its product (`products`).

    The runtime measures them at load (`llama.runtime.choose_quantized_kernels`) and sets `kernels`: (most rows,
    product name) pairs by increasing row count; a product of more rows than the last pair's runs the last pair's
    product. Unmeasured, and inside a compiled step (where torch.compile fuses it), each runs its device's default."""

    CPU_DEFAULT = GPU_DEFAULT = ""

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.kernels: Tuple[Tuple[int, str], ...] = ()

    def unpack(self) -> nn.Module:
        raise ValueError("A quantized layer has no fairscale form: its weight is no longer in floating point")

    def products(self, rows: int) -> dict:
        """Name to product (a function of the input) of each way to compute a product of `rows` rows here."""
        raise NotImplementedError

    def activation_dtype(self) -> torch.dtype:
        """The dtype of the inputs its products take: that of its scales."""
        raise NotImplementedError

    def default_product(self) -> str:
        return self.CPU_DEFAULT if self.weight.device.type == "cpu" else self.GPU_DEFAULT

    def kernel_for(self, rows: int) -> str:
        for most_rows, name in self.kernels:
            if rows <= most_rows:
                return name
        return self.kernels[-1][1] if self.kernels else self.default_product()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.products(0)[self.default_product()](x)
        rows = x.numel() // x.shape[-1]
        return self.products(rows)[self.kernel_for(rows)](x)


def int8_kernel_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """PyTorch's weight-only int8 kernel."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.aten._weight_int8pack_mm(rows, q, scales).view(*x.shape[:-1], -1)


def widened_in_blocks(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """On the CPU: the int8 weight widened to `x`'s dtype a block of rows at a time (`chunk_rows`) into one buffer
    reused for every block (a whole widened weight would be mapped afresh and fault in page by page at every call:
    several times slower), each block's product by `F.linear` (the CPU's matrix kernels, fast on many rows), then
    scaled."""
    rows = x.reshape(-1, x.shape[-1])
    step = chunk_rows(q.shape[1])
    buffer = torch.empty(min(step, q.shape[0]), q.shape[1], dtype=x.dtype)
    outputs = [F.linear(rows, buffer[: len(block)].copy_(block)) for block in q.split(step)]
    return (torch.cat(outputs, dim=-1) * scales).view(*x.shape[:-1], -1)


class Int8Linear(QuantizedLinear):
    """A fairscale linear layer with an int8 weight (`weight`, `scales`) in place of its float one.

    Products: "int8", PyTorch's int8 kernel (the CPU's default); "widened", the weight widened to the activations'
    dtype inside `F.linear` (the GPU's default, and what a compiled step fuses into one pass; on the CPU a block of
    rows at a time, for prompts); on a GPU "fused", that product compiled on its own, for one row, where
    torch.compile reads each int8 weight once."""

    CPU_DEFAULT, GPU_DEFAULT = "int8", "widened"

    def __init__(self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor):
        super().__init__(layer)
        del self.weight
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.out_features, self.in_features = q.shape  # this process's slice

    def products(self, rows: int) -> dict:
        if self.weight.device.type == "cpu":
            return {"int8": self.int8_product, "widened": self.widened_product}
        products = {"int8": self.int8_product, "widened": self.widened_product}
        if rows == 1:  # compiled for one row count only: a graph for each would be compiled at its first use
            products["fused"] = self.fused_product
        return products

    def activation_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def int8_product(self, x: torch.Tensor) -> torch.Tensor:
        return int8_kernel_product(x, self.weight, self.scales)

    def widened_product(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return widened_in_blocks(x, self.weight, self.scales)
        return widened_int8_product(x, self.weight, self.scales)

    def fused_product(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_on_cuda(widened_int8_product, x, self.weight, self.scales)


class Int4Linear(QuantizedLinear):
    """A fairscale linear layer with an int4 weight, held in the layout of PyTorch's int4 kernel for its device
    (`weight`, `scales_and_zeros`): a runtime form, not a file format (docs/quantize.md).

    Products off the CPU: "tinygemm", PyTorch's int4 kernel (the default), made for a few rows; "dequantized", the
    weight widened to the activations' dtype by one compiled kernel, then `F.linear`: for a prompt's rows, a
    product at the GPU's speed is worth one pass over the weight. It reads the values as quantized (`nibbles`,
    `group_scales`, `group_zeros`), which a GPU layer holds until the runtime's measurement finds whether any row
    count needs them (`drop_unused_copies`)."""

    CPU_DEFAULT = GPU_DEFAULT = "tinygemm"

    def __init__(self, layer: nn.Module, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        """`nibbles`: the values q in [0, 15], two per byte (`pack_nibbles`); `scales`, `zeros`: one column per
        group."""
        super().__init__(layer)
        del self.weight
        in_features = nibbles.shape[1] * 2
        self.group_size = in_features // scales.shape[1]
        if nibbles.device.type == "cpu":
            # Converted a block of rows at a time (the same bytes as all at once), to bound the int32 temporary.
            blocks = nibbles.split(chunk_rows(nibbles.shape[1] * 2))
            convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
            packed = torch.cat([convert(unpack_nibbles(block).to(torch.int32), 2) for block in blocks])
        else:  # the CUDA kernel takes the even input of each pair in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles << 4 | nibbles >> 4, inner_k_tiles(in_features))
            # Not saved with the model: the checkpoint's own form, kept for the "dequantized" product.
            self.register_buffer("nibbles", nibbles, persistent=False)
            self.register_buffer("group_scales", scales, persistent=False)
            self.register_buffer("group_zeros", zeros, persistent=False)
        self.register_buffer("weight", packed)
        # (groups, out_features, 2): each group's scale and zero, for every output channel
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).contiguous())
        self.out_features, self.in_features = nibbles.shape[0], nibbles.shape[1] * 2  # this process's slice

    def products(self, rows: int) -> dict:
        products = {"tinygemm": self.int4_product}
        if hasattr(self, "nibbles"):
            products["dequantized"] = self.dequantized_product
        return products

    def activation_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def int4_product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        scales_and_zeros = self.scales_and_zeros.to(x.dtype)
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group_size, scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        weight = compiled_on_cuda(dequantized_int4_weight, self.nibbles, self.group_scales, self.group_zeros)
        return F.linear(x, weight.to(x.dtype))

    def drop_unused_copies(self) -> None:
        """Free the quantized values' own copy when no chosen product reads it."""
        if hasattr(self, "nibbles") and all(name != "dequantized" for _, name in self.kernels):
            del self.nibbles, self.group_scales, self.group_zeros


def inner_k_tiles(in_features: int) -> int:
    """The CUDA int4 kernel's tiling of the inputs: the most tiles of 16 inputs (8, 4 or 2) that divide
    `in_features` evenly (Llama 3 8B's 4096 takes 8; SmolLM2's 576 only 4). Every int4 width, a multiple of 32,
    takes 2."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0)


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


def quantize_layer(layer: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """A quantized copy of one fairscale linear layer (or `ParallelLinear`), this process's slice of it."""
    if isinstance(layer, ParallelLinear):
        layer = layer.unpack()  # the fairscale layer, given its weight back
    weight = layer.weight
    row_parallel = isinstance(layer, RowParallelLinear)
    if scheme == "int4":
        mp_size = fs_init.get_model_parallel_world_size()
        size = int4_group_for(*whole_shape(layer), group_size, row_parallel, mp_size)
        if size is not None:
            return Int4Linear(layer, *quantize_int4(weight, size, weight.dtype))
    absmax = None
    if row_parallel:  # the whole row's largest magnitude, not this slice's
        absmax = max_over_model_parallel_group(row_absmax(weight))
    return Int8Linear(layer, *quantize_int8(weight, weight.dtype, absmax))


def is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, QuantizedLinear)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized layers' tensors (quantized values, scales and zeros) in `model`."""
    return sum(t.numel() * t.element_size() for m in model.modules() if is_quantized(m) for t in m.buffers())
