"""The Llama 3 architecture: a decoder-only transformer with RMSNorm, rotary position embeddings (RoPE),
grouped-query attention over a KV cache, and a SwiGLU feed-forward, split over model-parallel processes with
fairscale's layers. Module names are the checkpoint's keys, so a Meta state dict loads as it is.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from torch import nn

# Longest context, in tokens: Llama 3's, and that of Llama 3.1 and later, whose RoPE is scaled for it.
LLAMA3_CONTEXT = 8192
SCALED_ROPE_CONTEXT = 131072


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None  # None: one kv head per query head
    vocab_size: int = -1
    multiple_of: int = 256  # the SwiGLU width is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000
    use_scaled_rope: bool = False  # Llama 3.1 and later
    rope_scaling_factor: Optional[float] = None  # None means 8; Llama 3.2 1B/3B use 32

    max_batch_size: int = 32
    max_seq_len: int = 2048

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.rope_scaling_factor is not None and not self.use_scaled_rope:
            raise ValueError("rope_scaling_factor is set but use_scaled_rope is not; set use_scaled_rope: true")

    # Values derived from the fields, computed here only.
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """`n_kv_heads`, with None read as `n_heads`."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return FeedForward.hidden_size(4 * self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def context_len(self) -> int:
        """The most positions the checkpoint was trained for: the upper bound of `max_seq_len`."""
        return SCALED_ROPE_CONTEXT if self.use_scaled_rope else LLAMA3_CONTEXT


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def apply_scaling(freqs: torch.Tensor, scale_factor: float = 8) -> torch.Tensor:
    """Llama 3.1 RoPE scaling: divide low frequencies by `scale_factor`, keep high ones, blend in between."""
    low_freq_factor = 1
    high_freq_factor = 4
    old_context_len = LLAMA3_CONTEXT

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / scale_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_freqs_cis(
    dim: int,
    end: int,
    theta: float = 10000.0,
    use_scaled: bool = False,
    scale_factor: Optional[float] = None,
    device: Optional[torch.device] = None,
):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: (dim // 2)].float() / dim))
    if use_scaled:
        freqs = apply_scaling(freqs, scale_factor or 8)
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # cos + i sin of every angle, complex64
    return freqs_cis


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    freqs_cis: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    # Adjacent pairs (x0, x1), (x2, x3), ... are rotated as complex numbers (interleaved layout).
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class KVCache(nn.Module):
    """The keys and values of every position seen so far, for each sequence of the batch.

    Runtime state, not weights: the buffers are left out of the state dict.
    """

    def __init__(self, max_batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        shape = (max_batch_size, max_seq_len, n_kv_heads, head_dim)
        self.register_buffer("cache_k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(
        self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor, first_row: int = 0
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the keys and values of positions [start_pos, start_pos + seqlen); return those of every position
        up to the last one stored, the ones the new positions attend to. The batch's sequences are the cache's rows
        from `first_row` on (the first rows, as in Meta's code, unless a server keeps each request in a row of its
        own)."""
        bsz, seqlen = xk.shape[:2]
        self.follow(xk)
        rows, end = slice(first_row, first_row + bsz), start_pos + seqlen
        self.cache_k[rows, start_pos:end] = xk
        self.cache_v[rows, start_pos:end] = xv
        return self.cache_k[rows, :end], self.cache_v[rows, :end]

    def follow(self, xk: torch.Tensor) -> None:
        """Move the cache to the activations' device and dtype where it is elsewhere."""
        if (self.cache_k.device, self.cache_k.dtype) != (xk.device, xk.dtype):
            self.cache_k, self.cache_v = self.cache_k.to(xk), self.cache_v.to(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.kv_heads
        model_parallel_size = fs_init.get_model_parallel_world_size()
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.head_dim

        self.wq = ColumnParallelLinear(
            args.dim, args.n_heads * self.head_dim, bias=False, gather_output=False, init_method=lambda x: x
        )
        self.wk = ColumnParallelLinear(
            args.dim, self.n_kv_heads * self.head_dim, bias=False, gather_output=False, init_method=lambda x: x
        )
        self.wv = ColumnParallelLinear(
            args.dim, self.n_kv_heads * self.head_dim, bias=False, gather_output=False, init_method=lambda x: x
        )
        self.wo = RowParallelLinear(
            args.n_heads * self.head_dim, args.dim, bias=False, input_is_parallel=True, init_method=lambda x: x
        )

        self.kv_cache = KVCache(args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
    ):
        """Attend from the new positions of `x` to themselves and to the cached ones.

        `mask` is added to the scores. None means no mask for one new position, and the causal mask for several:
        a prompt that starts at position 0.
        """
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = self.kv_cache.update(start_pos, xk, xv)

        xq = xq.transpose(1, 2)  # (bsz, n_local_heads, seqlen, head_dim)
        keys = keys.transpose(1, 2)  # (bsz, n_local_kv_heads, cache_len + seqlen, head_dim)
        values = values.transpose(1, 2)  # (bsz, n_local_kv_heads, cache_len + seqlen, head_dim)
        # softmax(xq keys^T / sqrt(head_dim) + mask) values, in one fused kernel: the scores are never stored whole,
        # and each kv head serves its n_rep query heads without being copied (grouped-query attention; Meta's code
        # copies them with repeat_kv). A prompt from position 0 is masked by the kernel itself (is_causal), which
        # skips the blocks above the diagonal.
        output = F.scaled_dot_product_attention(
            xq, keys, values, attn_mask=mask, is_causal=mask is None and seqlen > 1, enable_gqa=self.n_rep > 1
        )
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        multiple_of: int,
        ffn_dim_multiplier: Optional[float],
    ):
        super().__init__()
        hidden_dim = self.hidden_size(hidden_dim, multiple_of, ffn_dim_multiplier)

        self.w1 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False, init_method=lambda x: x)
        self.w2 = RowParallelLinear(hidden_dim, dim, bias=False, input_is_parallel=True, init_method=lambda x: x)
        self.w3 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False, init_method=lambda x: x)

    @staticmethod
    def hidden_size(hidden_dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
        """SwiGLU width: 2/3 of `hidden_dim` (4 * dim), scaled, rounded up to a multiple of `multiple_of`."""
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:  # 1.3 in Llama 3 8B and 70B's params.json
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.head_dim
        self.attention = Attention(args)
        self.feed_forward = FeedForward(
            dim=args.dim,
            hidden_dim=4 * args.dim,
            multiple_of=args.multiple_of,
            ffn_dim_multiplier=args.ffn_dim_multiplier,
        )
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
    ):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers

        self.tok_embeddings = VocabParallelEmbedding(params.vocab_size, params.dim, init_method=lambda x: x)

        self.layers = torch.nn.ModuleList()
        for layer_id in range(params.n_layers):
            self.layers.append(TransformerBlock(layer_id, params))

        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = ColumnParallelLinear(params.dim, params.vocab_size, bias=False, init_method=lambda x: x)

        self.freqs_cis = None  # the RoPE table, made where the model runs: by init_kv_caches or the first forward

    def rope_table(self, device: Optional[torch.device] = None) -> torch.Tensor:
        params = self.params
        return precompute_freqs_cis(
            params.head_dim,
            params.max_seq_len * 2,
            params.rope_theta,
            params.use_scaled_rope,
            params.rope_scaling_factor,
            device,
        )

    def init_kv_caches(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        """Allocate zeroed KV caches and the RoPE table on `device`: after building on the meta device, or to start
        afresh."""
        params = self.params
        for layer in self.layers:
            attention = layer.attention
            attention.kv_cache = KVCache(
                params.max_batch_size, params.max_seq_len, attention.n_local_kv_heads, params.head_dim, device, dtype
            )
        self.freqs_cis = self.rope_table(device)

    def rope_at(self, start_pos: int, seqlen: int, device: torch.device) -> torch.Tensor:
        """The RoPE table's rows for positions [start_pos, start_pos + seqlen), the table made on `device` first where
        it is not there yet."""
        if self.freqs_cis is None or self.freqs_cis.device != device:
            self.freqs_cis = self.rope_table(device)
        return self.freqs_cis[start_pos : start_pos + seqlen]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.rope_at(start_pos, seqlen, h.device)
        mask = causal_mask(seqlen, start_pos, h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        output = self.output(h).float()
        return output


def causal_mask(seqlen: int, start_pos: int, h: torch.Tensor) -> Optional[torch.Tensor]:
    """The mask added to the attention scores of `seqlen` new positions after `start_pos` cached ones.

    One new position attends to the whole cache: no mask. A prompt from position 0 gets the causal mask from the
    attention kernel itself (None). Any other chunk of positions needs it written out: row i is the token at
    position start_pos + i, which sees all start_pos cached positions (zeros on the left) and the new ones up to
    itself, so the -inf triangle sits start_pos columns to the right.
    """
    if seqlen == 1 or start_pos == 0:
        return None
    mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=h.device), diagonal=1)
    return torch.hstack([torch.zeros((seqlen, start_pos), device=h.device), mask]).type_as(h)
