"""Layers that always take the same input, run as one product: an attention's wq, wk and wv (`wqkv`), a
feed-forward's w1 and w3 (`w13`), as gpt-fast's `wqkv` and vLLM's merged layers do; on the CPU, per rank, for float
and int8 layers alike (`Stack`).

Where a row class's kernel runs on a copy of the weights (a float16 copy, fbgemm's int8: `STACKED_KERNELS`), the
stack makes one copy of the layers' weights stacked by rows and runs them as one product: fewer, larger calls,
where each call costs tens of microseconds beyond reading its weight (fbgemm_int8 some 100, writing its input as two
parts). Elsewhere (a kernel that reads the weights as loaded, or oneDNN's own copies) each layer runs alone. Each
output is computed as in its own layer's product: the same bits (tested). Llama 3.2 1B without stacks on a Zen 5
(`bench.py --baseline`, docs/speed.md): int8 decoded a batch of 8 at 0.85x, float32 one sequence at 0.89x to 0.99x.

The layers stay where they are, with their weights and state-dict keys, and are counted in the load report as
themselves; the stack holds no parameters, only its copy, made at load (`make_copies`) and again at its next use
after one of the weights was replaced or edited in place. The int4 layers are not stacked: their one-row kernel reads
the weights as packed at load (without stacks they decoded at 0.99x to 1.02x).
"""

from typing import Optional, Tuple

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from torch import nn

from llama.runtime.cpu.layers import CPULinear
from llama.runtime.parallel_layers import KernelLinear
from llama.runtime.quantized import Int8Linear

# The kernels whose copies a stack holds for its layers. Not oneDNN's bfloat16 layout: with w1 and w3 stacked on it,
# 1B's 512-token prompts ran at 0.922x the layers alone (Zen 5, docs/speed.md), and decode steps gained nothing.
STACKED_KERNELS = ("fp16", "fbgemm_int8")


class Stack(nn.Module):
    """`KernelLinear` layers of one class and one input, run as one product on one copy of their stacked weights in
    the row classes whose kernel runs on a copy (see the module)."""

    def __init__(self, *layers: KernelLinear):
        super().__init__()
        self.layers = layers  # a tuple, not submodules: the layers keep their own keys
        self.sizes = [layer.fairscale_layer.output_size_per_partition for layer in layers]
        self.copy = None  # (the kernel, each layer's tensors and their versions when copied, the copy)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Each layer's output for `x`, in the layers' order."""
        first = self.layers[0]
        kernel = first.kernel_for(x.numel() // max(1, x.shape[-1]))
        copy = self.stacked_copy(kernel) if kernel == self.copy_kernel() else None
        if copy is None:  # a kernel on the weights as loaded (or a float16 copy that cannot hold them): each alone
            return tuple(layer(x) for layer in self.layers)
        return type(first).on_copy(kernel, x, copy).split(self.sizes, -1)

    def copy_kernel(self) -> Optional[str]:
        """The kernel its layers run on a copy, where they all run the same kernels and it is one that runs stacked
        (`STACKED_KERNELS`); else None: each layer alone."""
        kernel = self.layers[0].copy_kernel() if len({layer.kernels for layer in self.layers}) == 1 else None
        return kernel if kernel in STACKED_KERNELS else None

    def claim(self) -> None:
        """Tell its layers whether it holds their copy (`KernelLinear.in_stack`), before any copy is made."""
        for layer in self.layers:
            layer.in_stack = self.copy_kernel() is not None

    def tensors(self) -> list:
        """Each layer's tensors its copy is made of, with their versions."""
        return [(tensor, tensor._version) for layer in self.layers for tensor in layer.buffers(recurse=False)] + [
            (layer.weight, layer.weight._version) for layer in self.layers if isinstance(layer.weight, nn.Parameter)
        ]

    def stacked_copy(self, kernel: str):
        """The copy of the stacked weights for `kernel`, made again first where a weight was replaced or edited."""
        tensors = self.tensors()
        held = self.copy is not None and self.copy[0] == kernel and len(self.copy[1]) == len(tensors)
        if not held or any(a is not b or v != w for (a, v), (b, w) in zip(self.copy[1], tensors)):
            self.copy = None  # the old copy freed first
            self.copy = (kernel, tensors, type(self.layers[0]).copy_of(kernel, self.layers))
        return self.copy[2]

    def make_copies(self) -> None:
        """Make the copy its layers' kernels run on (none where they run on the weights as loaded)."""
        kernel = self.copy_kernel()
        if kernel is None:
            self.copy = None
        else:
            self.stacked_copy(kernel)

    def extra_repr(self) -> str:
        return "+".join(map(str, self.sizes))

    def __getstate__(self):
        return {**super().__getstate__(), "copy": None}  # an opaque packed copy cannot be copied: made again on use


def stacked(*layers: nn.Module) -> Optional[Stack]:
    """`layers` as one `Stack` where they are CPU layers of one class that runs on copies (`CPULinear`, `Int8Linear`),
    with weights of one dtype and of one input width, each this process's slice of a column-parallel layer whose
    outputs stay split (as Llama's wq, wk, wv, w1 and w3); else None (each layer runs alone)."""
    kind = type(layers[0])
    if kind not in (CPULinear, Int8Linear) or not all(type(layer) is kind for layer in layers):
        return None
    column_parallel = all(
        isinstance(layer.fairscale_layer, ColumnParallelLinear) and not layer.fairscale_layer.gather_output
        for layer in layers
    )
    alike = len({(layer.weight.dtype, layer.weight.device.type, layer.weight.shape[1]) for layer in layers}) == 1
    if not column_parallel or not alike or layers[0].weight.device.type != "cpu":
        return None
    if kind is Int8Linear and len({layer.scales.dtype for layer in layers}) > 1:
        return None
    return Stack(*layers)
