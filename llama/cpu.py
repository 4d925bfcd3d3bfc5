"""CPU speed-up, applied at load: each linear layer's matmul on the CPU kernel that runs it fastest.

It keeps the reference math; only the order in which products are summed changes. Tests hold logits within
1e-4 of the reference math in float32 and greedy tokens equal. Figures: `benchmarks/bench.py`.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region, reduce_from_model_parallel_region


def onednn_supported(device: torch.device) -> bool:
    """Whether this torch build can run `CPULinear` layers on `device`."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class CPULinear(nn.Module):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the fastest CPU kernel.

    On the AMD EPYC we measure on, `F.linear` reads a weight at about 60% of the memory bandwidth for one row
    of input (a decode step): float32 runs on MKL, and bfloat16 on oneDNN, which first reorders the weight
    into its blocked layout on every call. Here float32 runs on oneDNN, which reads the weight as loaded at
    over 80% (and is 2x faster at batch 8), and a single bfloat16 row on PyTorch's own matrix-vector product,
    which does too. The forward is fairscale's with that matmul in place of `F.linear`, for inference only;
    the weight is the same parameter, so it can be edited or tied as usual.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        if layer.bias is not None or not getattr(layer, "input_is_parallel", True):
            raise ValueError("CPULinear takes Llama's layers only: no bias, row-parallel input already split")
        self.weight = layer.weight  # the same tensor, so a tied head stays tied to the embedding
        layer.weight = None
        self.plain = layer  # keeps the layer's settings, and gives it back in unpack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        # What fairscale does with the product: a row-parallel layer sums the partial products over the
        # model-parallel group, and a column-parallel one may gather the split outputs.
        if isinstance(self.plain, RowParallelLinear):
            return reduce_from_model_parallel_region(y)
        if self.plain.gather_output:
            return gather_from_model_parallel_region(y)
        return y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.compile picks its own kernels
            return F.linear(x, self.weight)
        if self.weight.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if x.numel() == x.shape[-1]:  # one row
            with onednn_disabled():
                return F.linear(x, self.weight)
        return F.linear(x, self.weight)

    def unpack(self) -> nn.Module:
        """The fairscale layer, with this weight."""
        self.plain.weight = self.weight
        return self.plain


@contextmanager
def onednn_disabled():
    """PyTorch's own kernels in place of oneDNN's; the user's setting is restored afterwards."""
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def _replace_layers(model: nn.Module, kind, replacement) -> None:
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, kind):
                setattr(module, name, replacement(child))


def use_cpu_linear_layers(model: nn.Module) -> None:
    """Replace every fairscale linear layer in `model` with a `CPULinear`, in place."""
    _replace_layers(model, (ColumnParallelLinear, RowParallelLinear), CPULinear)


def unpack_linear_layers(model: nn.Module) -> None:
    """Undo `use_cpu_linear_layers`, in place: the reference's fairscale layers (and its kernels)."""
    _replace_layers(model, CPULinear, CPULinear.unpack)


def speed_up_for_cpu(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Apply this module's speed-ups to a loaded `Transformer`, where this torch build supports them."""
    if not onednn_supported(device):
        return
    if dtype in (torch.float32, torch.bfloat16):
        use_cpu_linear_layers(model)
