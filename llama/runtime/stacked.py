"""int8 layers that always take the same input, stacked into one product on the CPU (`StackedInt8`): an attention's
wq, wk and wv, a feed-forward's w1 and w3. A decode step then makes two int8 products a layer instead of five: each
call costs some tens of microseconds beyond reading its weight (the "split" product some 100, for splitting its
input), and a larger weight is read nearer the memory's speed (docs/quantize-kernels.md has the figures).
"""

import itertools
from typing import Optional, Tuple

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from torch import nn

from llama.runtime.quantized import Int8Linear


class StackedInt8(Int8Linear):
    """`Int8Linear` layers of one input, as one `Int8Linear` of their values stacked (outputs in the layers' order),
    whose products are timed and chosen like any other's (`llama.runtime.quantized_kernels`). Each output is computed
    as in its own layer's product, on any of the products: the same bits (tested).

    The layers stay where they are, with their state-dict keys; their values become views of the stack's (held once),
    which is itself left out of the state dict. In the load report the stack's product counts once for each of its
    layers (`layer_count`)."""

    def __init__(self, *layers: Int8Linear):
        stand_in = nn.Module()  # for the fairscale layer an `Int8Linear` wraps: the stacked layers keep theirs
        stand_in.weight = stand_in.bias = None
        super().__init__(stand_in, *stacked(layers))
        self.register_buffer("weight", self.weight, persistent=False)
        self.register_buffer("scales", self.scales, persistent=False)
        self.sizes = [layer.out_features for layer in layers]
        self.layers = layers  # a tuple, not submodules: the layers keep their own keys
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


def stacked(layers: Tuple[Int8Linear, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The int8 values and the scales of `layers`, each stacked in the layers' order."""
    return torch.cat([layer.weight for layer in layers]), torch.cat([layer.scales for layer in layers])


def stacked_int8(*layers: nn.Module) -> Optional[StackedInt8]:
    """`layers` as one `StackedInt8` where they are int8 layers on the CPU, with scales of one dtype, each this
    process's slice of a column-parallel layer whose outputs stay split (as Llama's wq, wk, wv, w1 and w3); else
    None."""
    if not all(isinstance(layer, Int8Linear) and layer.weight.device.type == "cpu" for layer in layers):
        return None
    column_parallel = all(
        isinstance(layer.plain, ColumnParallelLinear) and not layer.plain.gather_output for layer in layers
    )
    if not column_parallel or len({layer.scales.dtype for layer in layers}) > 1:
        return None
    return StackedInt8(*layers)
