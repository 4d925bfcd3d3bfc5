"""The quantized layer each scheme makes of a linear layer (`quantize_layer`): the weight-only int8 and int4 of
`llama.runtime.quantized`, and int4-dyn's of `llama.runtime.onnx_int4`."""

from typing import Optional

from torch import nn

from llama.runtime.onnx_int4 import int4_dyn_layer
from llama.runtime.parallel_layers import ParallelLinear
from llama.runtime.quantized import quantize_layer as weight_only_layer


def quantize_layer(layer: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """A quantized copy of one fairscale linear layer (or `ParallelLinear`), this process's slice of it, in `scheme`;
    under int4-dyn, a layer that int4 cannot hold is int8, as under int4."""
    if isinstance(layer, ParallelLinear):
        layer = layer.unpack()  # the fairscale layer, given its weight back
    if scheme == "int4-dyn":
        return int4_dyn_layer(layer) or weight_only_layer(layer, "int8")
    return weight_only_layer(layer, scheme, group_size)
