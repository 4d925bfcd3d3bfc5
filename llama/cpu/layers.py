"""The CPU's linear layers: `CPULinear` runs each row count on the kernel chosen for it, `FusedProduct` runs
products of one input (wq, wk, wv; w1, w3) as one on a shared copy."""

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

from llama.cpu.kernels import (
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
from llama.distributed import global_rank
from llama.parallel_layers import ParallelLinear, layers_of_kind

logger = logging.getLogger(__name__)


class CPULinear(ParallelLinear):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the kernel chosen for it.

    `kernels` maps row counts to kernels (`KERNELS`): an input of n rows runs on the kernel of the smallest count
    that is at least n, or of the largest count (a long prompt). `speed_up_for_cpu` chooses them by measuring.
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
        self.kernels = dict(sorted(kernels.items()))
        self.packed = {}  # kernel -> (the weight and its version when copied, the copy)
        self.fused: Optional[FusedProduct] = None  # for kernels on a copy: one shared with layers of the same input

    def kernel_for(self, rows: int) -> str:
        return next(
            (kernel for count, kernel in self.kernels.items() if rows <= count), self.kernels[max(self.kernels)]
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.compile picks its own kernels
            return F.linear(x, self.weight)
        kernel = self.kernel_for(x.numel() // max(1, x.shape[-1]))
        on_a_copy = kernel == "fp16" or (kernel == "onednn" and self.weight.dtype != torch.float32)
        if on_a_copy and self.fused is not None:
            y = self.fused.output(self, x, kernel)
            return F.linear(x, self.weight) if y is None else y
        if kernel == "fp16":
            packed = self.packed_copy("fp16")
            return F.linear(x, self.weight) if packed is None else fp16_linear(x, packed)
        return run_kernel(kernel, x, self.weight, self.packed_copy("onednn") if on_a_copy else None)

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


class FusedProduct:
    """One copy of the stacked weights of `CPULinear` layers that always take the same input (an attention's wq, wk
    and wv; a feed-forward's w1 and w3), for their kernels that run on a copy: "fp16" (fbgemm's float16 copy) and,
    in bfloat16, "onednn" (oneDNN's blocked layout). The first layer called with an input computes all their
    products at once, and the others take their share when called with that same input object (each output column
    is summed as in a product of its layer alone: the same bits, tested). Fewer, larger products: each call costs
    some 20 to 40 us beyond reading its weight on 2 cores, and a larger weight is read nearer the memory's speed
    (`benchmarks/on_off.py fused`). The layers keep their own weights and state-dict keys; a copy is made again at
    its next use when any of them was replaced or edited in place.
    """

    def __init__(self, layers: List["CPULinear"]):
        self.layers = layers
        self.packed = {}  # kernel -> (each weight and its version when packed, the packed copy)
        self.pending = None  # (an input, its kernel, the outputs for it that layers have not taken yet)

    def packed_copy(self, kernel: str = "fp16"):
        """The stacked weights' copy for `kernel` (for "fp16", None where float16 cannot hold one of them), made
        again if one of them was replaced or changed in place since (`unchanged`)."""
        weights = [layer.weight for layer in self.layers]
        if kernel not in self.packed or not unchanged(self.packed[kernel][0], weights):
            self.packed.pop(kernel, None)  # free the old copy first
            self.packed[kernel] = (with_versions(weights), weight_copy(kernel, *weights))
        return self.packed[kernel][1]

    def output(self, layer: "CPULinear", x: torch.Tensor, kernel: str) -> Optional[torch.Tensor]:
        """`layer`'s product with `x` on `kernel` (None where float16 cannot hold the weights)."""
        pending = self.pending
        if pending is None or pending[0] is not x or pending[1] != kernel or layer not in pending[2]:
            packed = self.packed_copy(kernel)
            if packed is None:
                return None
            outputs = run_kernel(kernel, x, None, packed).split([layer.weight.shape[0] for layer in self.layers], -1)
            self.pending = pending = (x, kernel, dict(zip(self.layers, outputs)))
        output = pending[2].pop(layer)
        if not pending[2]:
            self.pending = None  # every layer has its share: let go of the input
        return output

    def __getstate__(self):
        return {**self.__dict__, "packed": {}, "pending": None}  # as CPULinear: a copy packs its own


def fuse_products(model: nn.Module) -> None:
    """Give each attention's wq, wk and wv, and each feed-forward's w1 and w3, one shared copy for their kernels
    that run on a copy (`FusedProduct`). In bfloat16 where oneDNN has bfloat16 kernels, every such group: oneDNN
    runs on a copy anyway. Elsewhere only for "fp16", where float16 holds their weights and their stack fits in one
    packed block: a larger stack is packed in blocks of rows anyway, whose outputs would have to be joined (for
    Llama 3.2 1B's w1 and w3, prompts ran about 4% slower)."""
    for block in model.layers:
        for group in (
            [block.attention.wq, block.attention.wk, block.attention.wv],
            [block.feed_forward.w1, block.feed_forward.w3],
        ):
            if not all(isinstance(layer, CPULinear) for layer in group):
                continue
            onednn = group[0].weight.dtype == torch.bfloat16 and onednn_bf16_supported()
            fp16 = (
                fbgemm_fp16_supported()
                and sum(layer.weight.numel() for layer in group) <= FP16_BLOCK_VALUES
                and all(holds_bfloat16_values(layer.weight) for layer in group)
            )
            if onednn or fp16:
                fused = FusedProduct(group)
                for layer in group:
                    layer.fused = fused


def products(model: nn.Module) -> List[List[CPULinear]]:
    """The products a step runs: the layers of each fused group together, every other `CPULinear` alone."""
    found = {}
    for layer in model.modules():
        if isinstance(layer, CPULinear):
            layers = layer.fused.layers if layer.fused is not None else [layer]
            found.setdefault(id(layers[0]), layers)
    return list(found.values())


def product_name(layers: List[CPULinear]) -> str:
    """What a product's kernel choice depends on: its dtype, its weights' shapes, and whether they are fused."""
    weight = layers[0].weight
    outputs = "+".join(str(layer.weight.shape[0]) for layer in layers)
    fused = " fused" if layers[0].fused is not None else ""
    return f"{str(weight.dtype).removeprefix('torch.')} {outputs}x{weight.shape[1]}{fused}"


def use_cpu_linear_layers(model: nn.Module, kernels: Optional[Dict[int, str]] = None) -> None:
    """Replace every fairscale linear layer in `model` with a `CPULinear` on `kernels` (see there), in place."""
    for parent, name, layer in layers_of_kind(model, (ColumnParallelLinear, RowParallelLinear)):
        setattr(parent, name, CPULinear(layer, kernels))


def make_fp16_copies(model: nn.Module) -> None:
    """Make the float16 copies of `model`'s `CPULinear` layers that run on them now rather than at each one's first
    use, on as many Python threads as torch uses: fbgemm packs a weight on one core."""
    layers = [m for m in model.modules() if isinstance(m, CPULinear) and "fp16" in m.kernels.values()]
    copies = {layer.fused or layer for layer in layers}  # a fused group's copy once
    start = time.perf_counter()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        made = sum(packed is not None for packed in pool.map(lambda owner: owner.packed_copy("fp16"), copies))
    seconds = time.perf_counter() - start
    if global_rank() == 0 and made:
        kept = f" ({len(copies) - made} of {len(copies)} not: float16 cannot hold them)" if made < len(copies) else ""
        logger.info("Made float16 copies of the weights for this CPU's kernels%s in %.2f seconds", kept, seconds)
