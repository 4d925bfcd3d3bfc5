"""What the CPU's float kernels need beyond `F.linear`: oneDNN (`onednn_supported`), fbgemm's products on float16
copies of the weights (`pack_as_fp16`, `fp16_linear`), and one new position's bfloat16 attention on float32 matmuls
(`one_position_attention`). Each keeps the reference math; they differ in the order of the sums only."""

import math
import sys
from typing import List, Optional

import torch
import torch.nn.functional as F


def onednn_supported(device: torch.device) -> bool:
    """Whether this torch build can run `CPULinear` layers on `device`."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def fbgemm_fp16_supported() -> bool:
    """Whether this torch build has fbgemm's float16-weight linear kernels (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_prepack_fp16"
    )


FP16_MAX = torch.finfo(torch.float16).max
FP16_BLOCK_VALUES = 2**24  # fbgemm packs blocks of this size faster than a large weight whole (docs/speed.md)


def holds_bfloat16_values(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 value: true of bfloat16 weights, and of float32 ones loaded
    from a bfloat16 checkpoint, whose low 16 bits are then zero (counted on a view of them: no copy is made)."""
    if weight.dtype == torch.bfloat16:
        return True
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return False
    low_halves = weight.view(torch.int16).view(*weight.shape, 2)[..., 0 if sys.byteorder == "little" else 1]
    return int(torch.count_nonzero(low_halves)) == 0


def pack_as_fp16(weight: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """fbgemm's packed float16 copy of `weight`, in blocks of rows, or None where float16 cannot hold it: a value
    that is not a bfloat16 value (`holds_bfloat16_values`), lies outside float16's range, or is not finite.

    Within that range float16 holds every bfloat16 value exactly, except those below 2**-17 in magnitude, which
    it rounds to a multiple of 2**-24 (float16's subnormals): a change below 3e-8 per weight.
    """
    if not holds_bfloat16_values(weight):
        return None
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
    packed weight (a TorchScript object) that lookup raises an AttributeError in C++ and catches it, most of a small
    product's time (docs/speed.md). With torch functions of tensor subclasses switched off for the call (the
    activations are plain tensors), the lookup is skipped.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return [torch.ops.quantized.linear_dynamic_fp16(rows, block) for block in packed]


def fp16_linear(x: torch.Tensor, packed: List[torch.Tensor]) -> torch.Tensor:
    """`x @ weight.T` on the packed float16 weight: float32 input and sums, the result rounded to `x.dtype`."""
    y = fp16_products(x.reshape(-1, x.shape[-1]).float(), packed)
    y = y[0] if len(y) == 1 else torch.cat(y, dim=-1)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def one_position_attention(
    xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, from_positions: int = 0
) -> torch.Tensor:
    """bfloat16 attention of one new position per sequence (`RuntimeAttention.one_position_attention`), rounded where
    Meta's code rounds it: the scores to bfloat16, then divided by sqrt(head_dim) in bfloat16, the softmax (in
    float32) to bfloat16, and the weighted sum of values to bfloat16. The products of bfloat16 values are exact in
    float32, so float32 matmuls give Meta's bfloat16 matmuls but for the order of their sums.

    SDPA's bfloat16 kernel attends one position several times more slowly than this on long caches, and faster on
    short ones (docs/speed.md); below `from_positions` positions it runs instead (the kernel table's
    `MATMUL_ATTENTION_FROM`).
    """
    bsz, n_heads, _, head_dim = xq.shape
    n_kv_heads, positions = keys.shape[1], keys.shape[2]
    if positions < from_positions:
        return F.scaled_dot_product_attention(xq, keys, values, enable_gqa=n_heads > n_kv_heads)
    # Query head h attends with kv head h // (n_heads // n_kv_heads), as Meta's repeat_kv pairs them.
    queries = xq.reshape(bsz, n_kv_heads, n_heads // n_kv_heads, head_dim).float()
    scores = torch.matmul(queries, keys.float().transpose(2, 3)).to(xq.dtype).div_(math.sqrt(head_dim))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(xq.dtype)
    output = torch.matmul(probs.float(), values.float()).to(xq.dtype)
    return output.view(bsz, n_heads, 1, head_dim)
