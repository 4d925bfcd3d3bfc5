"""The quantized linear layers (`Int8Linear`, `Int4Linear`): a weight quantized by `llama.quantize` and the kernels
that compute its product (`KERNELS`), one per row class, from the kernel table (`llama.runtime.kernel_table`).
`quantize_layer` makes one from a fairscale linear layer, as the checkpoint loads or as `quantize_model` runs.
`Int4Embedding`: a token embedding table held in int4, which a 4-bit GGUF file brings.
"""

from typing import Optional, Sequence

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import RowParallelLinear
from torch import nn

from llama.quantize import (
    chunk_rows,
    dequantize,
    int4_group_for,
    quantize_int4,
    quantize_int8,
    row_absmax,
    unpack_nibbles,
    whole_shape,
)
from llama.runtime.cpu.integer import pack_int8, two_part_product, two_part_product_available
from llama.runtime.cpu.widened import cpu_int4_block_rows, widened_in_blocks, widened_int4_in_blocks
from llama.runtime.parallel_layers import KernelLinear, ParallelLinear, vocab_parallel_lookup

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


class QuantizedLinear(KernelLinear):
    """A linear layer with quantized weights, whose product runs on one of its kernels (`KERNELS`) per row class:
    the kernel table's (`llama.runtime.kernel_table`), else PyTorch's own weight-only kernel (`default_kernel`).
    Inside a compiled step each runs its device's default, which torch.compile fuses."""

    CPU_DEFAULT = GPU_DEFAULT = ""
    CPU_ONLY = ("widened32", "fbgemm_int8")  # kernels of the CPU alone
    CUDA_ONLY = ("compiled", "dequantized")  # kernels of CUDA alone

    def unpack(self) -> nn.Module:
        raise ValueError("A quantized layer has no fairscale form: its weight is no longer in floating point")

    def default_kernel(self) -> str:
        return self.CPU_DEFAULT if self.weight.device.type == "cpu" else self.GPU_DEFAULT

    def runs(self, kernel: str) -> bool:
        on_cpu = self.weight.device.type == "cpu"
        return kernel in self.KERNELS and kernel not in (self.CUDA_ONLY if on_cpu else self.CPU_ONLY)

    def activation_dtype(self) -> torch.dtype:
        """The dtype of the inputs its kernels take: that of its scales."""
        raise NotImplementedError

    def values_bytes(self) -> int:
        """Bytes of its quantized values, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in self.buffers())


def int8_kernel_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """PyTorch's weight-only int8 kernel."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.aten._weight_int8pack_mm(rows, q, scales).view(*x.shape[:-1], -1)


def int4_cpu_product(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
    """PyTorch's int4 kernel for the CPU, on a weight in its layout (`_convert_weight_to_int4pack_for_cpu`)."""
    rows, scales_and_zeros = x.reshape(-1, x.shape[-1]), scales_and_zeros.to(x.dtype)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_and_zeros)
    return y.view(*x.shape[:-1], packed.shape[0])


class Int8Linear(QuantizedLinear):
    """A fairscale linear layer with an int8 weight (`weight`, `scales`) in place of its float one.

    Kernels: "int8", PyTorch's weight-only int8 kernel (the CPU's default); "widened", the weight widened to the
    activations' dtype inside `F.linear` (the GPU's default, and what a compiled step fuses into one pass; on the CPU
    a block of rows at a time, `llama.runtime.cpu.widened`); on the CPU "widened32", the same in float32, and
    "fbgemm_int8", in integers on fbgemm's copy of the weight, the activations written as two 7-bit parts
    (`llama.runtime.cpu.integer`; for 16-bit activations only); on a GPU "compiled", the widened product compiled on
    its own, where torch.compile reads each int8 weight once."""

    CPU_DEFAULT, GPU_DEFAULT = "int8", "widened"

    def __init__(self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor):
        super().__init__(layer)
        del self.weight
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.packed = None  # fbgemm's copy of the weight, for "fbgemm_int8"
        self.out_features, self.in_features = q.shape  # this process's slice

    def weights(self) -> str:
        return f"int8 {str(self.scales.dtype).removeprefix('torch.')}"

    def runs(self, kernel: str) -> bool:
        if kernel == "fbgemm_int8":
            # Only for 16-bit activations, whose own rounding (1/512 of each value in bfloat16) the two parts'
            # rounding stays far below: a float32 model's products stay as exact as they were.
            sixteen_bits = self.scales.dtype in (torch.bfloat16, torch.float16)
            return sixteen_bits and self.weight.device.type == "cpu" and two_part_product_available()
        return super().runs(kernel)

    def activation_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def copy_kernel(self) -> Optional[str]:
        return "fbgemm_int8" if "fbgemm_int8" in (self.kernels or ()) else None

    def on_a_copy(self, kernel: str) -> bool:
        return kernel == "fbgemm_int8"

    def copy_bytes(self) -> int:
        return self.weight.numel() if self.copy_kernel() else 0

    def make_copies(self) -> None:
        """Make fbgemm's copy of the weight if its kernels use it (and it runs alone: a stack holds its layers'),
        and free it if not."""
        if self.in_stack or self.copy_kernel() is None:
            self.packed = None
        elif self.packed is None:
            self.packed = self.copy_of("fbgemm_int8", [self])

    @staticmethod
    def copy_of(kernel: str, layers: Sequence["Int8Linear"]):
        """fbgemm's packed copy of the layers' values stacked by rows."""
        if len(layers) == 1:
            return pack_int8(layers[0].weight, layers[0].scales)
        return pack_int8(torch.cat([layer.weight for layer in layers]), torch.cat([layer.scales for layer in layers]))

    @staticmethod
    def on_copy(kernel: str, x: torch.Tensor, copy) -> torch.Tensor:
        return two_part_product(x, copy)

    def int8(self, x: torch.Tensor) -> torch.Tensor:
        return int8_kernel_product(x, self.weight, self.scales)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return widened_in_blocks(x, self.weight, self.scales)
        return widened_int8_product(x, self.weight, self.scales)

    def widened32(self, x: torch.Tensor) -> torch.Tensor:
        return widened_in_blocks(x, self.weight, self.scales, torch.float32)

    def fbgemm_int8(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            self.packed = self.copy_of("fbgemm_int8", [self])
        return two_part_product(x, self.packed)

    def compiled(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_on_cuda(widened_int8_product, x, self.weight, self.scales)

    KERNELS = {
        "int8": int8,
        "widened": widened,
        "widened32": widened32,
        "fbgemm_int8": fbgemm_int8,
        "compiled": compiled,
    }


class Int4Linear(QuantizedLinear):
    """A fairscale linear layer with an int4 weight, held in the layout of PyTorch's int4 kernel for its device
    (`weight`, `scales_and_zeros`): a runtime form, not a file format (docs/quantize.md).

    Kernels: "int4pack", PyTorch's int4 kernel of the device (the default; tinygemm's on CUDA), made for a few rows.
    On the CPU, for a prompt's rows, "widened" and "widened32": the weight dequantized a block at a time to the
    activations' dtype (where oneDNN multiplies bfloat16) or to float32, then the CPU's matrix kernels
    (`llama.runtime.cpu.widened`). On CUDA, "dequantized": the weight widened to the activations' dtype by one
    compiled kernel, then `F.linear`: for a prompt's rows, a product at the GPU's speed is worth one pass over the
    weight. It reads the values as quantized (`nibbles`, `group_scales`, `group_zeros`), which a GPU layer holds
    only where the table gives it "dequantized" (`make_copies`)."""

    CPU_DEFAULT = GPU_DEFAULT = "int4pack"

    def __init__(self, layer: nn.Module, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        """`nibbles`: the values q in [0, 15], two per byte (`pack_nibbles`); `scales`, `zeros`: one column per
        group."""
        super().__init__(layer)
        del self.weight
        in_features = nibbles.shape[1] * 2
        self.group_size = in_features // scales.shape[1]
        if nibbles.device.type == "cpu":
            # Converted a block of rows at a time (the same bytes as all at once) into the whole, to bound the int32
            # temporary.
            step, convert = chunk_rows(in_features), torch.ops.aten._convert_weight_to_int4pack_for_cpu
            packed = torch.empty_like(nibbles)
            for start in range(0, nibbles.shape[0], step):
                packed[start : start + step] = convert(unpack_nibbles(nibbles[start : start + step]).to(torch.int32), 2)
        else:  # the CUDA kernel takes the even input of each pair in the high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles << 4 | nibbles >> 4, inner_k_tiles(in_features))
            # Not saved with the model: the checkpoint's own form, kept for the "dequantized" kernel.
            self.register_buffer("nibbles", nibbles, persistent=False)
            self.register_buffer("group_scales", scales, persistent=False)
            self.register_buffer("group_zeros", zeros, persistent=False)
        self.register_buffer("weight", packed)
        # (groups, out_features, 2): each group's scale and zero, for every output channel
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).contiguous())
        self.out_features, self.in_features = nibbles.shape[0], nibbles.shape[1] * 2  # this process's slice

    def weights(self) -> str:
        return "int4"

    def runs(self, kernel: str) -> bool:
        if kernel in ("widened", "widened32") and self.weight.device.type == "cpu":
            block_rows = cpu_int4_block_rows()
            return block_rows is not None and self.out_features % block_rows == 0
        if kernel == "dequantized":
            return hasattr(self, "nibbles")
        return super().runs(kernel)

    def activation_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def make_copies(self) -> None:
        """Free the quantized values' own copy where no kernel of its reads it."""
        if hasattr(self, "nibbles") and "dequantized" not in (self.kernels or ()):
            del self.nibbles, self.group_scales, self.group_zeros

    def int4pack(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return int4_cpu_product(x, self.weight, self.scales_and_zeros, self.group_size)
        rows, scales_and_zeros = x.reshape(-1, x.shape[-1]), self.scales_and_zeros.to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group_size, scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        return widened_int4_in_blocks(x, self.weight, self.scales_and_zeros, self.group_size)

    def widened32(self, x: torch.Tensor) -> torch.Tensor:
        return widened_int4_in_blocks(x, self.weight, self.scales_and_zeros, self.group_size, torch.float32)

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        weight = compiled_on_cuda(dequantized_int4_weight, self.nibbles, self.group_scales, self.group_zeros)
        return F.linear(x, weight.to(x.dtype))

    KERNELS = {"int4pack": int4pack, "widened": widened, "widened32": widened32, "dequantized": dequantized}


def inner_k_tiles(in_features: int) -> int:
    """The CUDA int4 kernel's tiling of the inputs: the most tiles of 16 inputs (8, 4 or 2) that divide
    `in_features` evenly (Llama 3 8B's 4096 takes 8; SmolLM2's 576 only 4). Every int4 width, a multiple of 32,
    takes 2."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0)


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


class Int4Embedding(nn.Module):
    """fairscale's `VocabParallelEmbedding` with its table in int4 (`llama.quantize`'s groups with a scale and a zero
    each): a lookup dequantizes only the rows of its tokens, into the dtype of `scales`. Each process holds a slice
    of the vocabulary's rows, as fairscale's does."""

    def __init__(self, layer: nn.Module, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        """`layer`: the fairscale embedding it replaces (for its slice of the vocabulary); `nibbles`, `scales`,
        `zeros`: this slice's rows, as `Int4Linear` takes them. The nibbles are its `weight`, as a quantized
        checkpoint names them (and where the model's device is asked for); the scales' dtype is the model's."""
        super().__init__()
        self.register_buffer("weight", nibbles)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.vocab_start, self.vocab_end = layer.vocab_start_index, layer.vocab_end_index

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(self.weight[flat], self.scales[flat], self.zeros[flat]).to(self.scales.dtype)
        return rows.view(*ids.shape, -1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(tokens, self.vocab_start, self.vocab_end, self.rows)


def is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, QuantizedLinear)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized layers' quantized values, scales and zeros in `model`."""
    return sum(m.values_bytes() for m in model.modules() if is_quantized(m))
