"""CPU speed-up, applied at load: each linear layer's matmul on the CPU kernel that runs it fastest.

It keeps the reference math; only the order in which products are summed changes. Tests hold logits within
1e-4 of the reference math in float32 and greedy tokens equal. Figures: `benchmarks/bench.py`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

from llama.distributed import available_memory
from llama.parallel_layers import ParallelLinear, replace_layers


def onednn_supported(device: torch.device) -> bool:
    """Whether this torch build can run `CPULinear` layers on `device`."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def onednn_bf16_supported() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX-512 or AVX-NE-CONVERT); without them it cannot pack
    bfloat16 weights, and AVX2 machines lack them."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and check()


class CPULinear(ParallelLinear):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the fastest CPU kernel.

    On the AMD EPYC we measure on, `F.linear` reads a weight at about 60% of the memory bandwidth for one row
    of input (a decode step): float32 runs on MKL, and bfloat16 on oneDNN, which first reorders the weight
    into its blocked layout on every call. Here float32 runs on oneDNN, which reads the weight as loaded at
    over 80% (and is 2x faster at batch 8), and a single bfloat16 row on PyTorch's own matrix-vector product,
    which does too. With `pack_weights`, bfloat16 inputs of several rows (prompts, decode steps of several
    sequences) run on a copy of the weight in oneDNN's layout, made at the first such input and again whenever
    the weight has changed since: the same oneDNN kernel as `F.linear` (bit-identical results) without the
    reorder on every call.
    The forward is fairscale's with that matmul in place of `F.linear` (`ParallelLinear`); the weight is the
    same parameter, so it can be edited or tied as usual.
    """

    def __init__(self, layer: nn.Module, pack_weights: bool = False):
        if pack_weights and not onednn_bf16_supported():
            raise ValueError("pack_weights needs oneDNN's bfloat16 kernels, which this CPU lacks (no AVX-512)")
        super().__init__(layer)
        self.pack_weights = pack_weights
        self.packed = None  # (weight, its version when packed, the packed copy)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.compile picks its own kernels
            return F.linear(x, self.weight)
        if self.weight.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if x.numel() == x.shape[-1]:  # one row: PyTorch's own matrix-vector product, what F.linear runs without oneDNN
            return torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], -1)
        if self.pack_weights:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), None, "none", [], "")
        return F.linear(x, self.weight)

    def packed_weight(self) -> torch.Tensor:
        """The weight in oneDNN's blocked layout, packed again if it was replaced or changed in place since.

        A change is seen through the tensor's version counter, which in-place ops bump (under `torch.no_grad()`
        or `load_state_dict`); writes through `.data` do not bump it.
        """
        if self.packed is None or self.packed[0] is not self.weight or self.packed[1] != self.weight._version:
            self.packed = None  # free the old copy first
            self.packed = (self.weight, self.weight._version, torch.ops.mkldnn._reorder_linear_weight(self.weight))
        return self.packed[2]

    def __getstate__(self):
        # An opaque oneDNN tensor cannot be copied or saved; a copy of this layer packs its own on use.
        return {**super().__getstate__(), "packed": None}


def use_cpu_linear_layers(model: nn.Module, pack_weights: bool = False) -> None:
    """Replace every fairscale linear layer in `model` with a `CPULinear`, in place."""
    replace_layers(model, (ColumnParallelLinear, RowParallelLinear), lambda layer: CPULinear(layer, pack_weights))


def speed_up_for_cpu(model: nn.Module) -> None:
    """Apply this module's speed-ups to a loaded `Transformer` (model-parallel layers still fairscale's), where it
    runs on the CPU in float32 or bfloat16 and this torch build supports them.

    In bfloat16, inputs of several rows get packed weights (for 1B on an AVX-512 machine: decode steps of 8
    sequences 1.5-1.9x faster, a prompt of 17 tokens 1.45x, of 256 tokens 2-3%) when the CPU has oneDNN's bfloat16
    kernels, the model may see batches, and a second copy of its weights fits in half the memory the system has
    available now.
    """
    weight = model.tok_embeddings.weight
    if not onednn_supported(weight.device) or weight.dtype not in (torch.float32, torch.bfloat16):
        return
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pack = (
        weight.dtype == torch.bfloat16
        and onednn_bf16_supported()
        and model.params.max_batch_size > 1
        and 2 * weight_bytes <= available_memory()
    )
    use_cpu_linear_layers(model, pack_weights=pack)
