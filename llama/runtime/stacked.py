"""Layers that always take the same input, run as one product: an attention's wq, wk and wv (`wqkv`), a
feed-forward's w1 and w3 (`w13`), stacked at load, per rank, as gpt-fast's `wqkv` and vLLM's merged layers.

Stacked where it measured a gain: int8 layers on the CPU (`StackedInt8`), where each call of the "fbgemm_int8"
kernel costs some 100 microseconds beyond reading its weight (writing the input as two parts), and a decode step then
makes two int8 products a block instead of five (Llama 3.2 1B on a Zen 5, int8 without the stacks: batch 8 at 0.85x,
docs/speed.md). Float and int4 layers are not stacked: without stacks they decoded within the machine's noise of
with them (1B, bfloat16 0.99x to 1.08x, float32 0.99x to 1.06x, int4 0.99x to 1.02x).

The layers stay where they are, with their state-dict keys; their values become views of the stack's (held once),
which is itself left out of the state dict. In the load report the stack counts once for each of its layers
(`layer_count`), and the layers inside it not at all.
"""

import itertools
from typing import Optional, Tuple

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from torch import nn

from llama.runtime.quantized import Int8Linear


class StackedInt8(Int8Linear):
    """`Int8Linear` layers of one input, as one `Int8Linear` of their values stacked (outputs in the layers' order),
    whose kernels the table gives as to any other. Each output is computed as in its own layer's product, on every
    kernel: the same bits (tested)."""

    def __init__(self, *layers: Int8Linear):
        q = torch.cat([layer.weight for layer in layers])
        scales = torch.cat([layer.scales for layer in layers])
        super().__init__(layers[0].fairscale_layer, q, scales)  # column-parallel, outputs split, as each layer
        self.register_buffer("weight", self.weight, persistent=False)
        self.register_buffer("scales", self.scales, persistent=False)
        self.sizes = [layer.out_features for layer in layers]
        self.layer_count = len(layers)
        for layer, stop in zip(layers, itertools.accumulate(self.sizes)):
            rows = slice(stop - layer.out_features, stop)
            layer.weight, layer.scales = self.weight[rows], self.scales[rows]
            layer.layer_count = 0  # its product runs in the stack's

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Each layer's output for `x`, in the layers' order."""
        return self.matmul(x).split(self.sizes, -1)

    def values_bytes(self) -> int:
        return 0  # its values are its layers', counted there

    def extra_repr(self) -> str:
        return "+".join(map(str, self.sizes)) + f"x{self.in_features} int8"


def stacked(*layers: nn.Module) -> Optional[StackedInt8]:
    """`layers` as one `StackedInt8` where they are int8 layers on the CPU with scales of one dtype, each this
    process's slice of a column-parallel layer whose outputs stay split (as Llama's wq, wk, wv, w1 and w3); else
    None (each layer runs alone)."""
    if not all(type(layer) is Int8Linear and layer.weight.device.type == "cpu" for layer in layers):
        return None
    column_parallel = all(
        isinstance(layer.fairscale_layer, ColumnParallelLinear) and not layer.fairscale_layer.gather_output
        for layer in layers
    )
    if not column_parallel or len({layer.scales.dtype for layer in layers}) > 1:
        return None
    return StackedInt8(*layers)
