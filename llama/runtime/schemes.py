"""The quantized layer each scheme makes of a linear layer (`quantize_layer`): the weight-only int8 and int4 of
`llama.runtime.quantized`, and int8-dyn's and int4-dyn's of `llama.runtime.onnx_dyn`; and of a model's layer by its
name (`quantize_named_layer`)."""

from typing import Optional

from torch import nn

from llama.quantize import layer_scheme
from llama.runtime.onnx_dyn import DynLinear, int4_dyn_layer, int8_dyn_layer
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


def quantize_named_layer(name: str, layer: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """`quantize_layer` for the model's layer called `name`, in the scheme it takes there (`layer_scheme`).

    An int8-dyn output head gets its ONNX Runtime session at once, and lets its values go. No fused product takes
    the head, so nothing is gained by waiting. Made with the other layers' sessions in `for_runtime`, the head's
    packing came on top of all of them, and raised the load's peak memory by a quarter (docs/quantize.md)."""
    quantized = quantize_layer(layer, layer_scheme(name, scheme), group_size)
    if name == "output" and isinstance(quantized, DynLinear):
        quantized.make_session()
    return quantized
