"""The quantized layer each scheme makes of a linear layer (`quantize_layer`): the weight-only int8 and int4 of
`llama.runtime.quantized`, and int8-dyn's and int4-dyn's of `llama.runtime.onnx_dyn`."""

from typing import Optional

from torch import nn

from llama.runtime.onnx_dyn import int4_dyn_layer, int8_dyn_layer
from llama.runtime.parallel_layers import ParallelLinear
from llama.runtime.quantized import quantize_layer as weight_only_layer


def quantize_layer(layer: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """A quantized copy of one fairscale linear layer (or `ParallelLinear`), this process's slice of it, in `scheme`.
    A layer that int4-dyn's groups cannot hold is int8-dyn, and one that int8-dyn's cannot hold is int8, as under
    int4 a layer that int4 cannot hold is int8."""
    if isinstance(layer, ParallelLinear):
        layer = layer.unpack()  # the fairscale layer, given its weight back
    if scheme == "int4-dyn":
        return int4_dyn_layer(layer) or quantize_layer(layer, "int8-dyn")
    if scheme == "int8-dyn":
        return int8_dyn_layer(layer) or weight_only_layer(layer, "int8")
    return weight_only_layer(layer, scheme, group_size)
