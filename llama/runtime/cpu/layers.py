"""The CPU's linear layers: `CPULinear` runs each row count on the kernel chosen for it, `FusedProduct` runs
products of one input (`FusedQKV`: wq, wk, wv; `FusedW13`: w1, w3) as one on a shared copy."""

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from llama.distributed import global_rank
from llama.runtime.cpu.kernels import (
    FP16_BLOCK_VALUES,
    KERNELS,
    fbgemm_fp16_supported,
    fp16_linear,
    holds_bfloat16_values,
    onednn_bf16_supported,
    run_kernel,
    unchanged,
    weight_copy,
    with_versions,
)
from llama.runtime.parallel_layers import MeasuredLinear

logger = logging.getLogger(__name__)


class CPULinear(MeasuredLinear):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the kernel chosen for it.

    `kernels` maps row counts to kernels (`KERNELS`; `MeasuredLinear`), `F.linear`'s until `choose_kernels`
    chooses them by measuring.
    The copies some kernels run on are made at their first use, and again whenever the weight has changed since
    (`packed_copy`): "fp16" runs on fbgemm's packed float16 copy (`pack_as_fp16`; where float16 cannot hold the
    weight, on `F.linear`), "onednn" in bfloat16 on a copy in oneDNN's blocked layout, the kernel `F.linear` runs
    there (bit-identical results) without reordering the weight on every call. The forward is fairscale's with
    that matmul in place of `F.linear` (`ParallelLinear`); the weight is the same parameter, so it can be edited
    or tied as usual.
    """

    def __init__(self, layer: nn.Module, kernels: Optional[Dict[int, str]] = None):
        super().__init__(layer)
        kernels = kernels or {1: "linear"}
        unknown = set(kernels.values()) - set(KERNELS)
        if unknown:
            raise ValueError(f"Unknown CPU kernels {sorted(unknown)}: the kernels are {', '.join(KERNELS)}")
        if "onednn" in kernels.values() and self.weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
            raise ValueError("The 'onednn' kernel needs oneDNN's bfloat16 kernels, which this CPU lacks (no AVX-512)")
        if "fp16" in kernels.values() and not fbgemm_fp16_supported():
            raise ValueError("The 'fp16' kernel needs fbgemm's float16 kernels, which this torch build lacks")
        self.kernels = kernels
        self.packed = {}  # kernel -> (the weight and its version when copied, the copy)

    def default_kernel(self) -> str:
        return "linear"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.compile picks its own kernels
            return F.linear(x, self.weight)
        kernel = self.kernel_for(rows_of(x))
        if kernel == "fp16":
            packed = self.packed_copy("fp16")
            return F.linear(x, self.weight) if packed is None else fp16_linear(x, packed)
        packed = self.packed_copy("onednn") if runs_on_a_copy(kernel, self.weight.dtype) else None
        return run_kernel(kernel, x, self.weight, packed)

    def packed_copy(self, kernel: str):
        """The weight's copy for `kernel` (None where `pack_as_fp16` cannot hold it), made again if the weight was
        replaced or changed in place since (`unchanged`)."""
        if kernel not in self.packed or not unchanged(self.packed[kernel][0], [self.weight]):
            self.packed.pop(kernel, None)  # free the old copy first
            self.packed[kernel] = (with_versions([self.weight]), weight_copy(kernel, self.weight))
        return self.packed[kernel][1]

    def __getstate__(self):
        # An opaque packed tensor cannot be copied or saved; a copy of this layer packs its own on use.
        return {**super().__getstate__(), "packed": {}}


def rows_of(x: torch.Tensor) -> int:
    """The rows of a product's input: every dimension but the last."""
    return x.numel() // max(1, x.shape[-1])


def runs_on_a_copy(kernel: str, dtype: torch.dtype) -> bool:
    """Whether `kernel` runs on a copy of the weights: fbgemm's float16 one, or oneDNN's blocked layout in bfloat16."""
    return kernel == "fp16" or (kernel == "onednn" and dtype != torch.float32)


class FusedProduct(nn.Module):
    """`CPULinear` layers that always take the same input, run as one product on one copy of their stacked weights
    where their kernel runs on a copy (`runs_on_a_copy`); each output column is summed as in a product of its layer
    alone, so the outputs are the same bits (tested). Fewer, larger products: each call costs some tens of
    microseconds beyond reading its weight, and a larger weight is read nearer the memory's speed
    (`benchmarks/on_off.py fused`, docs/speed.md).

    The layers stay where they are, with their weights and state-dict keys; this module holds no parameters of its
    own. Its copy is made again at its next use when any of the weights was replaced or edited in place. Where the
    layers' kernel runs on the weights as loaded, each layer runs alone.
    """

    def __init__(self, *layers: CPULinear):
        super().__init__()
        self.layers = layers  # a tuple, not submodules: the layers' parameters keep their own keys
        self.packed = {}  # kernel -> (each weight and its version when packed, the packed copy)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Each layer's output for `x`, in the layers' order."""
        kernel = "linear" if torch.compiler.is_compiling() else self.layers[0].kernel_for(rows_of(x))
        if not runs_on_a_copy(kernel, self.layers[0].weight.dtype):  # compiling: torch.compile picks its own kernels
            return tuple(layer(x) for layer in self.layers)
        packed = self.packed_copy(kernel)
        if packed is None:  # float16 cannot hold the weights
            return tuple(F.linear(x, layer.weight) for layer in self.layers)
        return run_kernel(kernel, x, None, packed).split([layer.weight.shape[0] for layer in self.layers], -1)

    def packed_copy(self, kernel: str = "fp16"):
        """The stacked weights' copy for `kernel` (for "fp16", None where float16 cannot hold one of them), made
        again if one of them was replaced or changed in place since (`unchanged`)."""
        weights = [layer.weight for layer in self.layers]
        if kernel not in self.packed or not unchanged(self.packed[kernel][0], weights):
            self.packed.pop(kernel, None)  # free the old copy first
            self.packed[kernel] = (with_versions(weights), weight_copy(kernel, *weights))
        return self.packed[kernel][1]

    def extra_repr(self) -> str:
        return product_name(self.layers)

    def __getstate__(self):
        return {**super().__getstate__(), "packed": {}}  # as CPULinear: a copy packs its own


class FusedQKV(FusedProduct):
    """An attention's wq, wk and wv as one product."""


class FusedW13(FusedProduct):
    """A feed-forward's w1 and w3 (the SwiGLU's gate and up projections) as one product."""


FUSED = {"qkv": FusedQKV, "w13": FusedW13}


def fused_product(name: str, *layers: nn.Module) -> Optional[FusedProduct]:
    """`layers` (that take one input: "qkv" or "w13") as one `FusedProduct` where their kernels can run on one
    copy, else None. In bfloat16 where oneDNN has bfloat16 kernels, always: oneDNN runs on a copy anyway. Elsewhere
    only for "fp16", where float16 holds their weights and their stack fits in one packed block: a larger stack is
    packed in blocks of rows anyway, whose outputs would have to be joined (slower prompts, docs/speed.md)."""
    if not all(isinstance(layer, CPULinear) for layer in layers):
        return None
    onednn = layers[0].weight.dtype == torch.bfloat16 and onednn_bf16_supported()
    fp16 = (
        fbgemm_fp16_supported()
        and sum(layer.weight.numel() for layer in layers) <= FP16_BLOCK_VALUES
        and all(holds_bfloat16_values(layer.weight) for layer in layers)
    )
    return FUSED[name](*layers) if onednn or fp16 else None


def product_owners(model: nn.Module) -> List[nn.Module]:
    """What runs each product of a step: each `FusedProduct`, and every `CPULinear` outside them."""
    fused = [module for module in model.modules() if isinstance(module, FusedProduct)]
    in_groups = {id(layer) for group in fused for layer in group.layers}
    return fused + [m for m in model.modules() if isinstance(m, CPULinear) and id(m) not in in_groups]


def layers_of(owner: nn.Module) -> Tuple[CPULinear, ...]:
    """The layers of the product `owner` runs: a `FusedProduct`'s, or a lone `CPULinear` itself."""
    return owner.layers if isinstance(owner, FusedProduct) else (owner,)


def products(model: nn.Module) -> List[Tuple[CPULinear, ...]]:
    """The layers of each product a step runs: a fused group's together, every other `CPULinear` alone."""
    return [layers_of(owner) for owner in product_owners(model)]


def product_name(layers: Sequence[CPULinear]) -> str:
    """What a product's kernel choice depends on: its dtype, its weights' shapes, and whether they are fused (more
    than one layer)."""
    weight = layers[0].weight
    outputs = "+".join(str(layer.weight.shape[0]) for layer in layers)
    return (
        f"{str(weight.dtype).removeprefix('torch.')} {outputs}x{weight.shape[1]}{' fused' if len(layers) > 1 else ''}"
    )


def make_weight_copies(model: nn.Module) -> None:
    """Make the copies of `model`'s weights that the chosen kernels run on (`runs_on_a_copy`: fbgemm's float16 ones,
    oneDNN's blocked bfloat16 ones) now, rather than at their first use, where the first prompt would wait for them
    (docs/speed.md has how long): on as many Python threads as torch uses, since fbgemm packs a weight on one core."""
    wanted = []
    for owner in product_owners(model):
        layer = layers_of(owner)[0]
        kernels = sorted({k for k in layer.kernels.values() if runs_on_a_copy(k, layer.weight.dtype)})
        wanted += [(owner, kernel) for kernel in kernels]
    start = time.perf_counter()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        made = list(pool.map(lambda item: (item[1], item[0].packed_copy(item[1]) is not None), wanted))
    seconds = time.perf_counter() - start
    counts = {kernel: sum(ok for k, ok in made if k == kernel) for kernel in ("fp16", "onednn")}
    if global_rank() == 0 and any(counts.values()):
        lost = sum(not ok for _, ok in made)
        kept = f" ({lost} not: float16 cannot hold them)" if lost else ""
        logger.info(
            "Made the weight copies this CPU's kernels run on (float16: %d, oneDNN: %d)%s in %.2f seconds",
            counts["fp16"],
            counts["onednn"],
            kept,
            seconds,
        )
