"""fairscale's model-parallel layers for inference: the same weights, state-dict keys and math, with the
collectives called directly.

fairscale runs each collective through an autograd.Function, for training. torch.compile cannot trace the one
that sums over the group (it calls `ctx.mark_dirty`), so with fairscale's layers a compiled decode step breaks
at every row-parallel layer and at the embedding, even in one process, where the sum does nothing. Broken inside
its loop over the layers, torch.compile runs that loop eagerly and compiles each layer's pieces apart: many small
graphs (and CUDA graphs), with Python between them. These layers skip the sum in one process, and in a compiled
graph of several processes run it as a functional all-reduce, which the graph includes: the decode step
compiles to a single graph.

`llama.runtime` uses them on every device (on CPU the linear layers are their subclass
`llama.runtime.cpu.layers.CPULinear`). In eager decoding they also skip the cost of fairscale's autograd.Functions, a
few hundred calls per token (figures: docs/speed.md).
"""

import collections
from typing import Callable, Dict, Optional, Tuple

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import RowParallelLinear
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region

from llama.runtime.kernel_table import ROW_CLASS_NAMES, ROW_CLASSES, row_class


def sum_over_model_parallel_group(x: torch.Tensor) -> torch.Tensor:
    """fairscale's all-reduce of partial results, skipped in one process (where it returns `x` as it is)."""
    if fs_init.get_model_parallel_world_size() == 1:
        return x
    if torch.compiler.is_compiling():  # a functional all-reduce, which torch.compile traces into the graph
        return funcol.all_reduce(x, "sum", fs_init.get_model_parallel_group())
    return reduce_from_model_parallel_region(x)


class InferenceLayer(nn.Module):
    """Holds a fairscale layer's weight, the same parameter under the same state-dict key, and the layer itself
    for its settings (and to give it back in `unpack`)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.weight = layer.weight  # the same tensor, so a tied head stays tied to the embedding
        layer.weight = None
        self.fairscale_layer = layer

    def unpack(self) -> nn.Module:
        """The fairscale layer, with this weight."""
        self.fairscale_layer.weight = self.weight
        return self.fairscale_layer


class ParallelLinear(InferenceLayer):
    """fairscale's `ColumnParallelLinear` or `RowParallelLinear` forward, for Llama's layers (no bias, row-parallel
    input already split)."""

    def __init__(self, layer: nn.Module):
        if layer.bias is not None or not getattr(layer, "input_is_parallel", True):
            name = type(self).__name__
            raise ValueError(f"{name} takes Llama's layers only: no bias, row-parallel input already split")
        super().__init__(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        # A row-parallel layer sums the partial products over the group; a column-parallel one may gather the
        # split outputs.
        if isinstance(self.fairscale_layer, RowParallelLinear):
            return sum_over_model_parallel_group(y)
        if self.fairscale_layer.gather_output and fs_init.get_model_parallel_world_size() > 1:
            return gather_from_model_parallel_region(y)
        return y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class KernelLinear(ParallelLinear):
    """A `ParallelLinear` whose product runs on one of several kernels (`KERNELS`, name -> function of the layer and
    the input), one per row class (`llama.runtime.kernel_table.ROW_CLASSES`), set by `llama.runtime.steps` from the
    kernel table. The CPU's float layers (`llama.runtime.cpu.layers.CPULinear`) and the quantized ones
    (`llama.runtime.quantized`) are its subclasses. A compiled step runs `compiled_kernel()`: torch.compile fuses its
    own product."""

    KERNELS: Dict[str, Callable[..., torch.Tensor]] = {}
    # Whether it is one of a stack of layers (`llama.runtime.stacked.Stack`), which then holds the copy of the
    # weights its kernels read, stacked with the others'.
    in_stack = False

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        # One kernel per row class, set by `llama.runtime.steps.use_table_kernels`; until then `default_kernel()`.
        self.kernels: Optional[Tuple[str, ...]] = None

    def default_kernel(self) -> str:
        """PyTorch's own kernel for this product: what runs where the kernel table has no row for it."""
        raise NotImplementedError

    def compiled_kernel(self) -> str:
        return self.default_kernel()

    def weights(self) -> str:
        """What the kernel table calls this layer's weights ("bfloat16", "int4", ...)."""
        raise NotImplementedError

    def runs(self, kernel: str) -> bool:
        """Whether `kernel` can run this product here (this device, this build, these weights)."""
        return kernel in self.KERNELS

    def copy_kernel(self) -> Optional[str]:
        """The kernel of its row classes that runs on a copy of the weight (at most one), or None."""
        return None

    def on_a_copy(self, kernel: str) -> bool:
        """Whether `kernel` runs on a copy of the weight (made at load: `make_copies`)."""
        return False

    def copy_bytes(self) -> int:
        """Bytes of the copy of the weight its kernels run on (`make_copies`)."""
        return 0

    def make_copies(self) -> None:
        """Make the copy of the weight its kernels run on, and free one they no longer run on."""

    def kernel_for(self, rows: int) -> str:
        if torch.compiler.is_compiling():
            return self.compiled_kernel()
        return self.default_kernel() if self.kernels is None else self.kernels[row_class(rows)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.KERNELS[self.kernel_for(x.numel() // max(1, x.shape[-1]))](self, x)


def kernels_in_use(model: nn.Module) -> Optional[str]:
    """The kernels the `KernelLinear` layers of `model` run on in each row class, each with the number of layers
    that run it: "1 row: fp16 113; 2-16 rows: fp16 113; ...". None where there are no such layers (float layers off
    the CPU: `F.linear`)."""
    layers = [layer for layer in model.modules() if isinstance(layer, KernelLinear)]
    if not layers:
        return None
    counts = [collections.Counter() for _ in ROW_CLASSES]
    for layer in layers:
        for counted, kernel in zip(counts, layer.kernels or [layer.default_kernel()] * len(ROW_CLASSES)):
            counted[kernel] += 1
    return "; ".join(
        f"{name}: " + ", ".join(f"{kernel} {n}" for kernel, n in counted.most_common())
        for name, counted in zip(ROW_CLASS_NAMES, counts)
    )


def vocab_parallel_lookup(
    tokens: torch.Tensor, start: int, end: int, rows: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """fairscale's `VocabParallelEmbedding` lookup, where this process holds the vocabulary's rows [start, end) and
    `rows(ids)` gives those of its own rows `ids`."""
    if fs_init.get_model_parallel_world_size() == 1:
        return rows(tokens)
    # Tokens outside this process's rows get zeros here, and their rows from the process that holds them.
    outside = (tokens < start) | (tokens >= end)
    found = rows((tokens - start).masked_fill(outside, 0))
    return sum_over_model_parallel_group(found.masked_fill(outside[..., None], 0.0))


class ParallelEmbedding(InferenceLayer):
    """fairscale's `VocabParallelEmbedding` forward: each process holds a slice of the vocabulary's rows."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        start, end = self.fairscale_layer.vocab_start_index, self.fairscale_layer.vocab_end_index
        return vocab_parallel_lookup(tokens, start, end, lambda ids: F.embedding(ids, self.weight))
