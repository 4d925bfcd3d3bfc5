"""fairscale's model-parallel layers for inference: the same weights, state-dict keys and math, with the
collectives called directly.

fairscale runs each collective through an autograd.Function, for training. torch.compile cannot trace the one
that sums over the group (it calls `ctx.mark_dirty`), so with fairscale's layers a compiled decode step breaks
at every row-parallel layer and at the embedding, even in one process, where the sum does nothing. Broken inside
its loop over the layers, torch.compile runs that loop eagerly and compiles each layer's pieces apart: many small
graphs (and CUDA graphs), with Python between them. These layers skip the sum in one process, and in a compiled
graph of several processes run it as a functional all-reduce, which the graph includes: the decode step
compiles to a single graph.

`llama.runtime` uses them on every device (on CPU the linear layers are their subclass `llama.runtime.cpu.CPULinear`).
In eager decoding they also skip the cost of fairscale's autograd.Functions, a few hundred calls per token (figures:
docs/speed.md).
"""

import collections
import itertools
from typing import Callable, Dict, Optional

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import RowParallelLinear
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region


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
        self.plain = layer

    def unpack(self) -> nn.Module:
        """The fairscale layer, with this weight."""
        self.plain.weight = self.weight
        return self.plain


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
        if isinstance(self.plain, RowParallelLinear):
            return sum_over_model_parallel_group(y)
        if self.plain.gather_output and fs_init.get_model_parallel_world_size() > 1:
            return gather_from_model_parallel_region(y)
        return y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MeasuredLinear(ParallelLinear):
    """A `ParallelLinear` with several kernels for its product, one chosen per row count by measuring them at load
    (the CPU's float kernels, `llama.runtime.cpu.CPULinear`; the quantized products, `llama.runtime.quantized`).

    `kernels` maps row counts to kernel names: an input of n rows runs on the kernel of the smallest count that is at
    least n, or of the largest count (a long prompt); with none chosen, on `default_kernel()`."""

    # How many of the model's layers its product stands for in the load report (`kernels_in_use`): 0 for a layer
    # whose product runs inside a stack of layers (`llama.runtime.stacked`), the stack's layers for the stack.
    layer_count = 1

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.kernels = {}

    @property
    def kernels(self) -> Dict[int, str]:
        return self._kernels

    @kernels.setter
    def kernels(self, chosen: Dict[int, str]) -> None:
        self._kernels = dict(sorted(chosen.items()))  # by row count, as `kernel_for` reads them

    def default_kernel(self) -> str:
        raise NotImplementedError

    def kernel_for(self, rows: int) -> str:
        if not self.kernels:
            return self.default_kernel()
        return next(
            (kernel for count, kernel in self.kernels.items() if rows <= count), self.kernels[max(self.kernels)]
        )


def kernels_in_use(model: nn.Module) -> Optional[str]:
    """The kernels the `MeasuredLinear` layers of `model` run on at each row count any of them was chosen for, each
    with the number of layers that run it: "1 row: mv 64, linear 49; 256 rows: fp16 113". None where there are no
    such layers (float layers off the CPU: `F.linear`)."""
    layers = [layer for layer in model.modules() if isinstance(layer, MeasuredLinear) and layer.layer_count]
    if not layers:
        return None
    row_counts = sorted({rows for layer in layers for rows in layer.kernels}) or [1]
    counts = {rows: collections.Counter() for rows in row_counts}
    for rows, layer in itertools.product(row_counts, layers):
        counts[rows][layer.kernel_for(rows)] += layer.layer_count
    return "; ".join(
        f"{rows} row{'s' * (rows > 1)}: " + ", ".join(f"{kernel} {n}" for kernel, n in counted.most_common())
        for rows, counted in counts.items()
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
        start, end = self.plain.vocab_start_index, self.plain.vocab_end_index
        return vocab_parallel_lookup(tokens, start, end, lambda ids: F.embedding(ids, self.weight))
