"""CPU speed-ups, applied at load: linear layers on oneDNN, and decode attention without oneDNN.

Both keep the reference math; only the order in which products are summed changes. Tests hold logits within
1e-4 of the reference math in float32 and greedy tokens equal. Figures: `benchmarks/bench.py`.
"""

import torch
import torch.nn as nn
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build can run `OneDNNLinear` layers for `device` and `dtype`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDNNLinear(nn.Module):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on oneDNN.

    `F.linear` runs float32 on MKL, whose matrix-vector product (a decode step) reads the weight at about half
    the memory bandwidth of the AMD EPYC we measure on; oneDNN reads it at close to full bandwidth, and is 3x
    faster at batch 8. `F.linear` runs bfloat16 on oneDNN already, but reorders the weight into oneDNN's
    blocked layout on every call; here a bfloat16 weight is reordered once, at load ("packed"), and is then
    read about 1.5x faster. The forward is fairscale's with oneDNN's matmul in place of `F.linear`, for
    inference only. `state_dict()` gives the weight in the ordinary layout; `unpack()` gives the fairscale
    layer back, for instance to edit a packed weight.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        if layer.bias is not None or not getattr(layer, "input_is_parallel", True):
            raise ValueError("OneDNNLinear takes Llama's layers only: no bias, row-parallel input already split")
        self.packed = layer.weight.dtype == torch.bfloat16
        if self.packed and not layer.weight.is_mkldnn:  # the loader packs as it reads, see linear_weight_keys
            self.weight = nn.Parameter(pack(layer.weight.detach()))
        else:
            self.weight = layer.weight  # float32: the same tensor, so a tied head stays tied to the embedding
        if self.packed:
            self._register_state_dict_hook(_dense_weight)
        layer.weight = None
        self.plain = layer  # keeps the layer's settings, and gives it back in unpack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        # What fairscale does with the product: a row-parallel layer sums the partial products over the
        # model-parallel group, and a column-parallel one may gather the split outputs.
        if isinstance(self.plain, RowParallelLinear):
            return reduce_from_model_parallel_region(y)
        if self.plain.gather_output:
            return gather_from_model_parallel_region(y)
        return y

    def unpack(self) -> nn.Module:
        """The fairscale layer, with this weight in the ordinary layout."""
        self.plain.weight = nn.Parameter(self.weight.to_dense()) if self.packed else self.weight
        return self.plain


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered into oneDNN's blocked layout for `OneDNNLinear`: a new, opaque tensor."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear_weight_keys(model: nn.Module, device: torch.device, dtype: torch.dtype) -> set:
    """The state-dict keys of the weights `speed_up_for_cpu` will pack: the loader packs them as it reads them,
    so that a rank never holds more than one unpacked copy at a time."""
    if not (onednn_supported(device, dtype) and dtype == torch.bfloat16):
        return set()
    kinds = (ColumnParallelLinear, RowParallelLinear)
    return {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, kinds)}


def _dense_weight(module, state_dict, prefix, local_metadata):
    state_dict[prefix + "weight"] = module.weight.to_dense()


def _replace_layers(model: nn.Module, kind, replacement) -> None:
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, kind):
                setattr(module, name, replacement(child))


def use_onednn_linear_layers(model: nn.Module) -> None:
    """Replace every fairscale linear layer in `model` with a `OneDNNLinear`, in place."""
    _replace_layers(model, (ColumnParallelLinear, RowParallelLinear), OneDNNLinear)


def unpack_linear_layers(model: nn.Module) -> None:
    """Undo `use_onednn_linear_layers`, in place: fairscale layers with weights in the ordinary layout, to
    edit a bfloat16 weight or `copy.deepcopy` the model."""
    _replace_layers(model, OneDNNLinear, OneDNNLinear.unpack)


def decode_attention_without_onednn(attention: nn.Module) -> None:
    """Run `attention`'s bfloat16 score and value matmuls on PyTorch's own kernels while decoding.

    oneDNN compiles a kernel for every new matmul shape, and each decode step attends over one more cached
    position: a new shape per step, which cost about 3 ms per layer here, more than the matmuls themselves.
    PyTorch's own kernels need no compiling and are fast for one query position, but far slower for a prompt,
    so prefill keeps oneDNN.
    """
    saved = []

    def before(module, args):
        saved.append(torch.backends.mkldnn.enabled)
        x = args[0]
        if x.shape[1] == 1:
            torch.backends.mkldnn.enabled = False

    def after(module, args, output):
        torch.backends.mkldnn.enabled = saved.pop()

    attention.register_forward_pre_hook(before)
    attention.register_forward_hook(after, always_call=True)


def speed_up_for_cpu(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Apply this module's speed-ups to a loaded `Transformer`, where this torch build supports them."""
    if not onednn_supported(device, dtype):
        return
    use_onednn_linear_layers(model)
    if dtype == torch.bfloat16:
        for layer in model.layers:
            decode_attention_without_onednn(layer.attention)
