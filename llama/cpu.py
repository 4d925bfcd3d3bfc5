"""CPU speed-up, applied at load: each linear layer's matmul on the CPU kernel that runs it fastest.

It keeps the reference math: only the order in which products are summed changes, and on float16 copies of
weights that hold bfloat16 values (`pack_as_fp16`: bfloat16 weights, or float32 ones from a bfloat16 checkpoint)
the smallest weights round by less than 3e-8. Tests hold logits within 1e-4 of the reference math in float32 and
greedy tokens equal. Figures: `benchmarks/bench.py`.
"""

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

from llama.distributed import available_memory, global_rank
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


def fbgemm_fp16_supported() -> bool:
    """Whether this torch build has fbgemm's float16-weight linear kernels (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_prepack_fp16"
    )


# From this many rows (a long prompt), float32 without a float16 copy runs on `F.linear` (MKL's GEMM), faster there
# than oneDNN on the weight as loaded (prompts of 512 tokens 1.05x to 1.12x: benchmarks/on_off.py mkl-prompts);
# about even at 128.
MKL_MIN_ROWS = 128
FP16_MAX = torch.finfo(torch.float16).max
FP16_BLOCK_VALUES = 2**24  # fbgemm packs blocks of this size 3-4x faster than a 128256-row head whole


def holds_bfloat16_values(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 value: true of bfloat16 weights, and of float32 ones loaded
    from a bfloat16 checkpoint, whose low 16 bits are then zero (counted on a view of them: no copy is made)."""
    if weight.dtype == torch.bfloat16:
        return True
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return False
    low_halves = weight.view(torch.int16).view(*weight.shape, 2)[..., 0 if sys.byteorder == "little" else 1]
    return int(torch.count_nonzero(low_halves)) == 0


def pack_as_fp16(*weights: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """fbgemm's packed float16 copy of `weights` stacked by rows (one weight, or the weights of layers that share
    an input), in blocks of rows, or None where float16 cannot hold them: a value that is not a bfloat16 value
    (`holds_bfloat16_values`; checked before anything is stacked), lies outside float16's range, or is not finite.

    Within that range float16 holds every bfloat16 value exactly, except those below 2**-17 in magnitude, which
    it rounds to a multiple of 2**-24 (float16's subnormals): a change below 3e-8 per weight.
    """
    if not all(holds_bfloat16_values(weight) for weight in weights):
        return None
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    rows = max(1, FP16_BLOCK_VALUES // weight.shape[1])
    packed = []
    for block in weight.detach().split(rows):
        block = block.float()
        if not (block.amax() <= FP16_MAX and block.amin() >= -FP16_MAX):  # also false for NaN
            return None
        packed.append(torch.ops.quantized.linear_prepack_fp16(block, None))
    return packed


def fp16_products(rows: torch.Tensor, packed: List[torch.Tensor]) -> List[torch.Tensor]:
    """fbgemm's product of float32 `rows` with each block of a packed float16 weight.

    Called as a `torch.ops` op, each product first looks for `__torch_function__` on its arguments, and on the
    packed weight (a TorchScript object) that lookup raises an AttributeError in C++ and catches it: some 14 us
    of a small product's 19 here, over 30 calls a step for a model of 8 layers. With torch functions of tensor
    subclasses switched off for the call (the activations are plain tensors), the lookup is skipped.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return [torch.ops.quantized.linear_dynamic_fp16(rows, block) for block in packed]


def fp16_linear(x: torch.Tensor, packed: List[torch.Tensor]) -> torch.Tensor:
    """`x @ weight.T` on the packed float16 weight: float32 input and sums, the result rounded to `x.dtype`."""
    y = fp16_products(x.reshape(-1, x.shape[-1]).float(), packed)
    y = y[0] if len(y) == 1 else torch.cat(y, dim=-1)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def with_versions(weights: List[torch.Tensor]) -> list:
    """Each weight with its version now, to tell later whether a copy made from them still holds them."""
    return [(weight, weight._version) for weight in weights]


def unchanged(recorded: list, weights: List[torch.Tensor]) -> bool:
    """Whether `weights` are the tensors `with_versions` recorded, none replaced or changed in place since.

    A change is seen through the tensor's version counter, which in-place ops bump (under `torch.no_grad()` or
    `load_state_dict`); writes through `.data` do not bump it.
    """
    return all(weight is old and weight._version == version for weight, (old, version) in zip(weights, recorded))


class CPULinear(ParallelLinear):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the fastest CPU kernel.

    On the AMD EPYC we measure on, `F.linear` reads a weight at about 60% of the memory bandwidth for one row
    of input (a decode step): float32 runs on MKL, and bfloat16 on oneDNN, which first reorders the weight
    into its blocked layout on every call. Here float32 without a copy (below) runs on oneDNN, which reads the
    weight as loaded at over 80% (and is 2x faster at batch 8) but runs long prompts slower than MKL
    (`MKL_MIN_ROWS`), and a single bfloat16 row on PyTorch's own matrix-vector product.
    A weight can also run on a packed copy, made when the weight is first used and again whenever it has changed
    since (`packing`):
    - "onednn": inputs of several rows (prompts, decode steps of several sequences) run on a copy in oneDNN's
      blocked layout, the same kernel as `F.linear` (bit-identical results) without the reorder on every call.
      It needs oneDNN's bfloat16 kernels (AVX-512 and later).
    - "fp16": inputs run on fbgemm's packed float16 copy (`pack_as_fp16`), in float32 arithmetic: every input
      of a bfloat16 weight, where oneDNN has no bfloat16 kernels (AVX2) and PyTorch widens each bfloat16 weight
      in a slow loop (one row at half the memory bandwidth, several rows 5 to 8 times slower than on the copy);
      and every input of a float32 weight that holds bfloat16 values (a bfloat16 checkpoint loaded in float32),
      which the copy holds in half the bytes: decode steps read half as much, and long prompts run faster than
      on MKL.
    The forward is fairscale's with that matmul in place of `F.linear` (`ParallelLinear`); the weight is the
    same parameter, so it can be edited or tied as usual.
    """

    def __init__(self, layer: nn.Module, packing: Optional[str] = None):
        if packing not in (None, "onednn", "fp16"):
            raise ValueError(f"packing must be None, 'onednn' or 'fp16', not {packing!r}")
        if packing == "onednn" and not onednn_bf16_supported():
            raise ValueError("packing='onednn' needs oneDNN's bfloat16 kernels, which this CPU lacks (no AVX-512)")
        if packing == "fp16" and not fbgemm_fp16_supported():
            raise ValueError("packing='fp16' needs fbgemm's float16 kernels, which this torch build lacks")
        super().__init__(layer)
        self.packing = packing
        self.packed = None  # (the weight and its version when packed, the packed copy)
        self.fused: Optional[FusedProduct] = None  # with packing "fp16": a copy shared with layers of the same input

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.compile picks its own kernels
            return F.linear(x, self.weight)
        if self.packing == "fp16" and (y := self.fp16_product(x)) is not None:
            return y
        if self.weight.dtype == torch.float32:
            if x.numel() >= MKL_MIN_ROWS * x.shape[-1]:
                return F.linear(x, self.weight)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if x.numel() == x.shape[-1]:  # one row: PyTorch's own matrix-vector product, what F.linear runs without oneDNN
            return torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], -1)
        if self.packing == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), None, "none", [], "")
        return F.linear(x, self.weight)

    def fp16_product(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """`x @ weight.T` on the float16 copy (or the copy shared with the layers fused with this one), or None
        where float16 cannot hold the weight."""
        if self.fused is not None:
            return self.fused.output(self, x)
        packed = self.packed_weight()
        return None if packed is None else fp16_linear(x, packed)

    def packed_weight(self):
        """The weight's packed copy (None where `pack_as_fp16` cannot hold it), packed again if the weight was
        replaced or changed in place since (`unchanged`)."""
        if self.packed is None or not unchanged(self.packed[0], [self.weight]):
            self.packed = None  # free the old copy first
            if self.packing == "fp16":
                packed = pack_as_fp16(self.weight)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            self.packed = (with_versions([self.weight]), packed)
        return self.packed[1]

    def __getstate__(self):
        # An opaque packed tensor cannot be copied or saved; a copy of this layer packs its own on use.
        return {**super().__getstate__(), "packed": None}


class FusedProduct:
    """One float16 copy of the stacked weights of `CPULinear` layers that always take the same input (an attention's
    wq, wk and wv; a feed-forward's w1 and w3): the first layer called with an input computes all their products
    at once, and the others take their share when called with that same input object (each output column is
    summed as in a product of its layer alone: the same bits, tested). Fewer, larger products: each fbgemm call
    costs some 20 to 40 us beyond reading its weight on 2 cores, and a larger weight is read nearer the memory's
    speed: a few percent, up to some 10% for batches (`benchmarks/on_off.py fused`). The layers keep their own
    weights and state-dict keys; the copy is made again at its next use when any of them was replaced or edited
    in place.
    """

    def __init__(self, layers: List["CPULinear"]):
        self.layers = layers
        self.packed = None  # (each weight and its version when packed, the packed copy)
        self.pending = None  # (an input, the outputs for it that layers have not taken yet)

    def packed_weight(self) -> Optional[List[torch.Tensor]]:
        """The stacked weights' float16 copy (None where float16 cannot hold one of them), made again if one of
        them was replaced or changed in place since (`unchanged`)."""
        weights = [layer.weight for layer in self.layers]
        if self.packed is None or not unchanged(self.packed[0], weights):
            self.packed = None  # free the old copy first
            self.packed = (with_versions(weights), pack_as_fp16(*weights))
        return self.packed[1]

    def output(self, layer: "CPULinear", x: torch.Tensor) -> Optional[torch.Tensor]:
        """`layer`'s product with `x` (None where float16 cannot hold the weights)."""
        pending = self.pending
        if pending is None or pending[0] is not x or layer not in pending[1]:
            packed = self.packed_weight()
            if packed is None:
                return None
            outputs = fp16_linear(x, packed).split([layer.weight.shape[0] for layer in self.layers], dim=-1)
            self.pending = pending = (x, dict(zip(self.layers, outputs)))
        output = pending[1].pop(layer)
        if not pending[1]:
            self.pending = None  # every layer has its share: let go of the input
        return output

    def __getstate__(self):
        return {**self.__dict__, "packed": None, "pending": None}  # as CPULinear: a copy packs its own


def fuse_fp16_products(model: nn.Module) -> None:
    """Give each attention's wq, wk and wv, and each feed-forward's w1 and w3, one shared float16 copy
    (`FusedProduct`), where they run on float16 copies and their stacked weights fit in one packed block: a larger
    stack is packed in blocks of rows anyway, whose outputs would have to be joined (for Llama 3.2 1B's w1 and w3,
    prompts ran about 4% slower)."""
    for block in model.layers:
        for group in (
            [block.attention.wq, block.attention.wk, block.attention.wv],
            [block.feed_forward.w1, block.feed_forward.w3],
        ):
            if (
                all(isinstance(layer, CPULinear) and layer.packing == "fp16" for layer in group)
                and sum(layer.weight.numel() for layer in group) <= FP16_BLOCK_VALUES
            ):
                fused = FusedProduct(group)
                for layer in group:
                    layer.fused = fused


# From this many scores (query heads x positions attended) on, `one_position_attention` runs on float32 matmuls;
# below it SDPA's bfloat16 kernel is about as fast or faster (4 to 32 heads over 16 to 64 positions: 14 to 92 us
# against 76 to 107 us, which a dozen small operations cost whatever their size).
MATMUL_ATTENTION_MIN_SCORES = 2048


def one_position_attention(xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """bfloat16 attention of one new position per sequence (`Attention.one_position_attention`), rounded where
    Meta's code rounds it: the scores to bfloat16, then divided by sqrt(head_dim) in bfloat16, the softmax (in
    float32) to bfloat16, and the weighted sum of values to bfloat16. The products of bfloat16 values are exact in
    float32, so float32 matmuls give Meta's bfloat16 matmuls but for the order of their sums.

    Where oneDNN has no bfloat16 kernels (AVX2), SDPA's bfloat16 kernel attends one position slowly: for 32 query
    heads over 1000 positions about 2.2 ms here, against 0.4 ms this way; in Llama 3.2 1B at position 600, 2 ms of
    each layer's 7.7 ms (profiled). Below `MATMUL_ATTENTION_MIN_SCORES` scores, SDPA is as fast and is kept.
    """
    bsz, n_heads, _, head_dim = xq.shape
    n_kv_heads, positions = keys.shape[1], keys.shape[2]
    if n_heads * positions < MATMUL_ATTENTION_MIN_SCORES:
        return F.scaled_dot_product_attention(xq, keys, values, enable_gqa=n_heads > n_kv_heads)
    # Query head h attends with kv head h // (n_heads // n_kv_heads), as Meta's repeat_kv pairs them.
    queries = xq.reshape(bsz, n_kv_heads, n_heads // n_kv_heads, head_dim).float()
    scores = torch.matmul(queries, keys.float().transpose(2, 3)).to(xq.dtype).div_(math.sqrt(head_dim))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(xq.dtype)
    output = torch.matmul(probs.float(), values.float()).to(xq.dtype)
    return output.view(bsz, n_heads, 1, head_dim)


def use_cpu_linear_layers(model: nn.Module, packing: Optional[str] = None) -> None:
    """Replace every fairscale linear layer in `model` with a `CPULinear`, in place."""
    replace_layers(model, (ColumnParallelLinear, RowParallelLinear), lambda layer: CPULinear(layer, packing))


def make_fp16_copies(model: nn.Module) -> None:
    """Make the float16 copies of `model`'s `CPULinear` layers now rather than at each one's first use, on as many
    Python threads as torch uses: fbgemm packs a weight on one core."""
    layers = [m for m in model.modules() if isinstance(m, CPULinear) and m.packing == "fp16"]
    copies = {layer.fused or layer for layer in layers}  # a fused group's copy once
    start = time.perf_counter()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        made = sum(packed is not None for packed in pool.map(lambda owner: owner.packed_weight(), copies))
    seconds = time.perf_counter() - start
    if global_rank() == 0 and made:
        kept = f" ({len(copies) - made} of {len(copies)} not: float16 cannot hold them)" if made < len(copies) else ""
        print(f"Made float16 copies of the weights for this CPU's kernels{kept} in {seconds:.2f} seconds")


def speed_up_for_cpu(model: nn.Module) -> None:
    """Apply this module's speed-ups to a loaded `Transformer` (model-parallel layers still fairscale's), where it
    runs on the CPU in float32 or bfloat16 and this torch build supports them.

    When a copy of the weights in 2 bytes each fits in half the memory the system has available now:
    - in bfloat16, where the CPU has oneDNN's bfloat16 kernels and the model may see batches, inputs of several
      rows run on oneDNN-packed weights, made at their first use (for 1B on an AVX-512 machine: decode steps of 8
      sequences 1.5-1.9x faster, a prompt of 17 tokens 1.45x, of 256 tokens 2-3%);
    - in bfloat16 elsewhere, with fbgemm (x86), every input runs on float16 copies, made here (on the 2-core AVX2
      machine we measure on, for Llama 3.2 1B: 11 to 14 s, then batch-1 decode 1.1 to 1.2x faster than on the
      bfloat16 weights, and prompts and batches 3 to 8x);
    - in float32, with fbgemm, weights that hold bfloat16 values (a bfloat16 checkpoint) run every input on
      float16 copies, made here (1B on the AVX2 machine: 7 s, then batch-1 decode about 1.6x and batch 8 about 2x
      faster than on oneDNN's float32 kernels: `benchmarks/on_off.py float32-copies`).
    In bfloat16 where oneDNN has no bfloat16 kernels, one new position attends through `one_position_attention`.
    """
    weight = model.tok_embeddings.weight
    if not onednn_supported(weight.device) or weight.dtype not in (torch.float32, torch.bfloat16):
        return
    copy_bytes = sum(p.numel() * 2 for p in model.parameters())  # a bfloat16 or float16 copy of every weight
    packing = None
    if 2 * copy_bytes <= available_memory():
        if weight.dtype == torch.bfloat16 and onednn_bf16_supported():
            packing = "onednn" if model.params.max_batch_size > 1 else None
        elif fbgemm_fp16_supported():
            packing = "fp16"
    use_cpu_linear_layers(model, packing)
    if weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
        for block in model.layers:
            block.attention.one_position_attention = one_position_attention
    if packing == "fp16":
        fuse_fp16_products(model)
        make_fp16_copies(model)
