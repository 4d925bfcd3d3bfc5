"""Attention as it runs here: the reference's `Attention` with the ways in that speed needs.

`RuntimeAttention` holds the reference layer's projections, cache and head counts, and adds:
- the decode step's cache write: a position given as a tensor, attention over the cache's first positions (as many
  as the mask has) with those not yet written masked out (`write_at_positions`), so that one compiled graph serves
  every step;
- per-row positions, and rows of the cache for the engine's requests (`KVCache.update`'s `first_row`);
- wq, wk and wv as one product where they are stacked (`wqkv`, `llama.runtime.stacked`);
- a kernel of its own for one new position's attention where the CPU has a faster one (`one_position_attention`).
"""

from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from llama.model import Attention, KVCache, apply_rotary_emb

# (xq, keys, values) -> output, in the layout of F.scaled_dot_product_attention's arguments and result.
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Given linear layers that always take the same input, one module that runs them as one product, returning each
# layer's output (`llama.runtime.stacked.stacked`), or None where they run alone.
MakeStack = Callable[..., Optional[nn.Module]]


def write_at_positions(
    cache: KVCache, positions: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, attended: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One new position per row, given as a tensor: one position for every row, or one for each row (rows that
    started at different times). Returns the cache of the batch's rows up to `attended` positions, unwritten ones
    among them: the caller's mask hides what lies past each row's position."""
    bsz = xk.shape[0]
    cache.follow(xk)
    if len(positions) == 1:
        cache.cache_k[:bsz].index_copy_(1, positions, xk)
        cache.cache_v[:bsz].index_copy_(1, positions, xv)
    else:
        rows = torch.arange(bsz, device=xk.device)
        cache.cache_k[rows, positions] = xk[:, 0]
        cache.cache_v[rows, positions] = xv[:, 0]
    return cache.cache_k[:bsz, :attended], cache.cache_v[:bsz, :attended]


def apply_rotary_emb_per_row(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_emb` for one new token per row, each row at a position of its own: xq and xk (bsz, 1, heads,
    head_dim), `freqs_cis` one row per batch row. The rows are rotated as the positions of one sequence."""
    xq, xk = apply_rotary_emb(xq.transpose(0, 1), xk.transpose(0, 1), freqs_cis=freqs_cis)
    return xq.transpose(0, 1), xk.transpose(0, 1)


def masked_one_position_attention(
    xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """SDPA of one new position per row, `xq` (bsz, n_heads, 1, head_dim), over `keys` and `values` (bsz, n_kv_heads,
    positions, head_dim), with `mask` (broadcast to (bsz, 1, 1, positions)). Masked kernels cannot share kv heads
    (enable_gqa copies them once per query head they serve: several times slower on the CPU in bfloat16), so each kv
    head's query heads attend as rows of one head: the same scores, nothing copied. CUDA's kernels return those rows
    transposed in memory, hence reshape."""
    bsz, n_heads, _, head_dim = xq.shape
    n_kv_heads = keys.shape[1]
    grouped = xq.reshape(bsz, n_kv_heads, n_heads // n_kv_heads, head_dim)
    output = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return output.reshape(bsz, n_heads, 1, head_dim)


class RuntimeAttention(nn.Module):
    """`Attention` of the same weights, cache and math, for every way the runtime calls it (see the module)."""

    def __init__(
        self,
        attention: Attention,
        one_position_attention: Optional[AttentionKernel] = None,
        stack: Optional[MakeStack] = None,
    ):
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = attention.n_local_heads, attention.n_local_kv_heads
        self.n_rep, self.head_dim = attention.n_rep, attention.head_dim
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo
        self.wqkv = stack(self.wq, self.wk, self.wv) if stack else None  # the three as one product, where stacked
        self.kv_cache = attention.kv_cache
        self.one_position_attention = one_position_attention

    def forward(
        self,
        x: torch.Tensor,
        start_pos: Union[int, torch.Tensor],
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
        first_row: int = 0,
    ) -> torch.Tensor:
        """`Attention.forward`, where `start_pos` may also be a tensor of positions (`write_at_positions`) and the
        batch may sit in the cache's rows from `first_row` on (`KVCache.update`)."""
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wqkv(x) if self.wqkv is not None else (self.wq(x), self.wk(x), self.wv(x))
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        if isinstance(start_pos, torch.Tensor):  # the fixed-shape step: positions as a tensor
            per_row = len(start_pos) > 1
            rotated = apply_rotary_emb_per_row if per_row else apply_rotary_emb
            xq, xk = rotated(xq, xk, freqs_cis=freqs_cis)
            keys, values = write_at_positions(self.kv_cache, start_pos, xk, xv, mask.shape[-1])
        else:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
            keys, values = self.kv_cache.update(start_pos, xk, xv, first_row)
        output = self.attend(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))

    def attend(
        self, xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """softmax(xq keys^T / sqrt(head_dim) + mask) values; `xq` (bsz, n_local_heads, seqlen, head_dim), `keys` and
        `values` (bsz, n_local_kv_heads, positions attended, head_dim); `mask` as `Attention.forward` takes it, or
        boolean (which positions may be attended to: the fixed-shape step's)."""
        bsz, _, seqlen, _ = xq.shape
        if seqlen == 1 and mask is None and self.one_position_attention is not None:
            return self.one_position_attention(xq, keys, values)
        if seqlen == 1 and mask is not None:
            return masked_one_position_attention(xq, keys, values, mask)
        return F.scaled_dot_product_attention(
            xq, keys, values, attn_mask=mask, is_causal=mask is None and seqlen > 1, enable_gqa=self.n_rep > 1
        )
