# Copyright (c) Meta Platforms, Inc. and affiliates.
# This software may be used and distributed in accordance with the terms of the Llama 3 Community License Agreement.

import math
from dataclasses import dataclass
from typing import Literal, Optional, Tuple, Union

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1
    multiple_of: int = 256  # make SwiGLU hidden layer size multiple of large power of 2
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000
    use_scaled_rope: bool = False  # Llama 3.1 and later
    rope_scaling_factor: Optional[float] = None  # None means 8; Llama 3.2 1B/3B use 32

    max_batch_size: int = 32
    max_seq_len: int = 2048

    def __post_init__(self):
        n_kv_heads = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        if self.rope_scaling_factor is not None and not self.use_scaled_rope:
            raise ValueError("rope_scaling_factor is set but use_scaled_rope is not; set use_scaled_rope: true")


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
    old_context_len = 8192  # original Llama 3 context

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
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        model_parallel_size = fs_init.get_model_parallel_world_size()
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads

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

        self.cache_shape = (args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim)
        self.init_cache()

    def init_cache(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        """(Re)allocate a zeroed KV cache; it is runtime state, so it is not part of the state dict."""
        self.register_buffer("cache_k", torch.zeros(self.cache_shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("cache_v", torch.zeros(self.cache_shape, device=device, dtype=dtype), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: Union[int, torch.Tensor],  # a tensor from Transformer.decode_step
        freqs_cis: torch.Tensor,
        mask: Union[torch.Tensor, Literal["causal"], None],
    ):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)

        if isinstance(start_pos, torch.Tensor):  # Transformer.decode_step: the whole cache, whatever the position
            self.cache_k[:bsz].index_copy_(1, start_pos, xk)
            self.cache_v[:bsz].index_copy_(1, start_pos, xv)
            keys, values = self.cache_k[:bsz], self.cache_v[:bsz]
        else:
            self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
            self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv

            keys = self.cache_k[:bsz, : start_pos + seqlen]
            values = self.cache_v[:bsz, : start_pos + seqlen]

        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        keys = keys.transpose(1, 2)  # (bs, n_local_kv_heads, cache_len + seqlen, head_dim)
        values = values.transpose(1, 2)  # (bs, n_local_kv_heads, cache_len + seqlen, head_dim)
        # softmax(xq keys^T / sqrt(head_dim) + mask) values, fused: the scores are never stored whole, and each
        # kv head serves n_rep query heads without being copied (grouped-query attention).
        if isinstance(mask, str):  # "causal": a whole prompt from position 0, see Transformer.forward
            output = F.scaled_dot_product_attention(xq, keys, values, is_causal=True, enable_gqa=self.n_rep > 1)
        else:
            output = F.scaled_dot_product_attention(xq, keys, values, attn_mask=mask, enable_gqa=self.n_rep > 1)
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
        # custom dim factor multiplier
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
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
        start_pos: Union[int, torch.Tensor],
        freqs_cis: torch.Tensor,
        mask: Union[torch.Tensor, Literal["causal"], None],
        last_position_only: bool = False,
    ):
        attended = self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        if last_position_only:  # every position's keys and values are cached now; only the last output is wanted
            x, attended = x[:, -1:], attended[:, -1:]
        h = x + attended
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

        self.freqs_cis = None  # the RoPE table, made on the model's device at the first forward

    def rope_table(self, device: Optional[torch.device] = None) -> torch.Tensor:
        params = self.params
        return precompute_freqs_cis(
            params.dim // params.n_heads,
            params.max_seq_len * 2,
            params.rope_theta,
            params.use_scaled_rope,
            params.rope_scaling_factor,
            device,
        )

    def init_kv_caches(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        """Allocate zeroed KV caches on `device` (after building on the meta device, or to start afresh)."""
        self.freqs_cis = None
        for layer in self.layers:
            layer.attention.init_cache(device, dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, last_logits_only: bool = False):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        if self.freqs_cis is None or self.freqs_cis.device != h.device:
            self.freqs_cis = self.rope_table(h.device)  # computed where the model runs, as in the reference
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]

        mask = None
        if seqlen > 1 and start_pos == 0:
            # With an empty cache the mask built below is the square causal one, which the fused attention
            # applies by itself, skipping the blocks above the diagonal: the same output, 1.8x faster at 2k tokens.
            mask = "causal"
        elif seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)

            mask = torch.triu(mask, diagonal=1)

            # When performing key-value caching, we compute the attention scores
            # only for the new sequence. Thus, the matrix of scores is of size
            # (seqlen, cache_len + seqlen), and the only masked entries are (i, j) for
            # j > cache_len + i, since row i corresponds to token cache_len + i.
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=tokens.device), mask]).type_as(h)

        # Sampling needs only the next token's distribution: with last_logits_only, the last layer's feed-forward
        # and the output head skip the other positions.
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask, last_position_only=last_logits_only and layer is self.layers[-1])
        h = self.norm(h)
        output = self.output(h).float()
        return output

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`forward(tokens, start_pos)` for one new token per row, in shapes that stay the same at every step.

        `position` is start_pos as a one-element tensor, and attention runs over the whole cache with the
        positions after it masked out, so that one compiled step (torch.compile, CUDA graphs) serves them all.
        The RoPE table must exist: a prompt has gone through `forward` first.
        """
        h = self.tok_embeddings(tokens)  # (bsz, 1, dim)
        freqs_cis = self.freqs_cis[position]  # (1, head_dim // 2)
        cache_positions = torch.arange(self.params.max_seq_len, device=tokens.device)
        mask = cache_positions[None, :] <= position[:, None]  # (1, max_seq_len): the positions written so far
        for layer in self.layers:
            h = layer(h, position, freqs_cis, mask)
        return self.output(self.norm(h)).float()
