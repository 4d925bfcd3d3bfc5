"""Cross-checks of llama/model.py against independent implementations, on tiny random float32 weights (CPU).

The references are written here from the published formulas (rotate-half RoPE, the Llama 3.1 frequency
scaling, RMSNorm), or taken from other code bases: `torch.nn.functional.scaled_dot_product_attention` for
attention and Hugging Face `transformers.LlamaForCausalLM` for the whole model. The Meta -> Hugging Face
weight conversion is written here too, so that a mistake in llama/checkpoint.py cannot hide one in the model.
"""

import copy
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import llama.cpu
from llama.checkpoint import load_model, model_args_from, open_checkpoint, write_meta_checkpoint
from llama.cpu import CPULinear
from llama.demo import random_weights
from llama.generation import compiled_decode_step
from llama.model import (
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    apply_rotary_emb,
    precompute_freqs_cis,
)
from llama.parallel_layers import ParallelEmbedding, ParallelLinear, unpack_layers, use_parallel_layers

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 logits of the same weights may differ by rounding only

GQA_PARAMS = {  # 4 query heads share 2 kv heads
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 512,
    "multiple_of": 32,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
MHA_PARAMS = {  # one kv head per query head, and a width multiplier as in Llama 3 8B/70B
    **GQA_PARAMS,
    "n_heads": 8,
    "n_kv_heads": 8,
    "multiple_of": 64,
    "ffn_dim_multiplier": 1.3,
    "norm_eps": 1e-6,
    "rope_theta": 10000.0,
}

# Hugging Face's name for the Llama 3.1 rule; only "factor" differs between Llama 3.1 (8) and 3.2 1B/3B (32).
HF_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# Independent references ---------------------------------------------------------------------------------------


def rope_frequencies(head_dim: int, theta: float) -> list:
    """RoPE frequencies theta^(-2i/d), i = 0 .. d/2 - 1, in plain float64 Python."""
    return [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]


def llama31_scaled_frequencies(head_dim: int, theta: float, factor: float = 8.0) -> list:
    """The Llama 3.1 rule from SPEC.md, one frequency at a time (low factor 1, high factor 4, context 8192)."""
    scaled = []
    for f in rope_frequencies(head_dim, theta):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:  # high frequency: kept
            scaled.append(f)
        elif wavelength > 8192 / 1:  # low frequency: divided by the factor
            scaled.append(f / factor)
        else:  # in between: blend the two
            s = (8192 / wavelength - 1) / (4 - 1)
            scaled.append((1 - s) * f / factor + s * f)
    return scaled


def rope_rotate_half(x: torch.Tensor, positions: torch.Tensor, freqs: list) -> torch.Tensor:
    """RoPE on x (bsz, seqlen, heads, head_dim) in Meta's interleaved layout, computed the rotate-half way.

    Each head's elements are first moved to the Hugging Face layout (the even elements of the pairs, then the
    odd ones), rotated with cos/sin tables as `x * cos + rotate_half(x) * sin`, and moved back.
    """
    half = x.shape[-1] // 2
    angles = positions.double()[:, None] * torch.tensor(freqs, dtype=torch.float64)[None, :]  # (seqlen, half)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :]  # (1, seqlen, 1, head_dim)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :]
    x_hf = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1).double()
    rotated = torch.cat([-x_hf[..., half:], x_hf[..., :half]], dim=-1)
    y_hf = x_hf * cos + rotated * sin
    y = torch.empty_like(y_hf)
    y[..., 0::2], y[..., 1::2] = y_hf[..., :half], y_hf[..., half:]
    return y.to(x.dtype)


def causal_mask(seqlen: int, start_pos: int) -> torch.Tensor:
    """(seqlen, start_pos + seqlen): row i (position start_pos + i) may see columns <= start_pos + i."""
    rows = torch.arange(seqlen)[:, None] + start_pos
    cols = torch.arange(start_pos + seqlen)[None, :]
    return torch.zeros(seqlen, start_pos + seqlen).masked_fill(cols > rows, float("-inf"))


def reference_attention(xq, keys, values, mask, n_rep: int) -> torch.Tensor:
    """Meta's attention math, step by step: kv heads repeated, scores, mask, float32 softmax, weighted values.

    xq is (bsz, seqlen, heads, head_dim), keys and values (bsz, kv_len, kv_heads, head_dim); the result is
    (bsz, seqlen, heads * head_dim).
    """
    bsz, seqlen, _, head_dim = xq.shape
    keys = keys.repeat_interleave(n_rep, dim=2).transpose(1, 2)  # (bsz, heads, kv_len, head_dim)
    values = values.repeat_interleave(n_rep, dim=2).transpose(1, 2)
    scores = torch.matmul(xq.transpose(1, 2), keys.transpose(2, 3)) / math.sqrt(head_dim)
    if mask is not None:
        scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    return torch.matmul(scores, values).transpose(1, 2).reshape(bsz, seqlen, -1)


def reference_attention_forward(self: Attention, x, start_pos, freqs_cis, mask):
    """`Attention.forward` as Meta wrote it: our projections, RoPE and cache, then `reference_attention` under
    Meta's mask, built here (the `mask` our Transformer passes is not used)."""
    bsz, seqlen, _ = x.shape
    mask = causal_mask(seqlen, start_pos).to(x.dtype) if seqlen > 1 else None
    xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
    xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
    self.cache_k = self.cache_k.to(xq)
    self.cache_v = self.cache_v.to(xq)
    self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
    self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
    keys, values = self.cache_k[:bsz, : start_pos + seqlen], self.cache_v[:bsz, : start_pos + seqlen]
    return self.wo(reference_attention(xq, keys, values, mask, self.n_rep))


def with_reference_attention(model: Transformer) -> Transformer:
    """`model`, its attention layers switched to `reference_attention_forward`."""
    for layer in model.layers:
        layer.attention.forward = types.MethodType(reference_attention_forward, layer.attention)
    return model


def to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows of a q or k projection from Meta's interleaved layout to rotate-half."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def meta_to_hf_weights(meta: dict, args: ModelArgs) -> dict:
    """Meta-named weights as a Hugging Face LlamaForCausalLM state dict (without lm_head if output is absent)."""
    n_kv_heads = args.n_kv_heads or args.n_heads
    hf = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"]}
    if "output.weight" in meta:
        hf["lm_head.weight"] = meta["output.weight"]
    for i in range(args.n_layers):
        m, h = f"layers.{i}.", f"model.layers.{i}."
        hf[h + "self_attn.q_proj.weight"] = to_hf_rows(meta[m + "attention.wq.weight"], args.n_heads)
        hf[h + "self_attn.k_proj.weight"] = to_hf_rows(meta[m + "attention.wk.weight"], n_kv_heads)
        hf[h + "self_attn.v_proj.weight"] = meta[m + "attention.wv.weight"]
        hf[h + "self_attn.o_proj.weight"] = meta[m + "attention.wo.weight"]
        hf[h + "mlp.gate_proj.weight"] = meta[m + "feed_forward.w1.weight"]
        hf[h + "mlp.down_proj.weight"] = meta[m + "feed_forward.w2.weight"]
        hf[h + "mlp.up_proj.weight"] = meta[m + "feed_forward.w3.weight"]
        hf[h + "input_layernorm.weight"] = meta[m + "attention_norm.weight"]
        hf[h + "post_attention_layernorm.weight"] = meta[m + "ffn_norm.weight"]
    return hf


def hf_model(meta: dict, args: ModelArgs, rope: dict = None, tie: bool = False, attn: str = "eager"):
    """A float32 transformers.LlamaForCausalLM with the same shapes and weights as our model."""
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=meta["layers.0.feed_forward.w1.weight"].shape[0],
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads or args.n_heads,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta, **(rope or {})},
        tie_word_embeddings=tie,
        attn_implementation=attn,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    weights = meta_to_hf_weights(meta, args)
    if tie:
        assert "lm_head.weight" not in weights
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def our_model(meta: dict, args: ModelArgs) -> Transformer:
    model = Transformer(args)
    model.load_state_dict(meta, strict=True)
    return model.eval()


def incremental_logits(model: Transformer, tokens: torch.Tensor, steps: list) -> torch.Tensor:
    """Logits for every position, fed to our model in pieces of the given sizes through the KV cache."""
    assert sum(steps) == tokens.shape[1]
    pieces, start_pos = [], 0
    for size in steps:
        pieces.append(model(tokens[:, start_pos : start_pos + size], start_pos))
        start_pos += size
    return torch.cat(pieces, dim=1)


# 1. RoPE -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("start_pos", [0, 1, 37, 1000, 4000])
def test_rope_matches_rotate_half_formulation(theta, start_pos):
    head_dim, seqlen = 16, 6
    generator = torch.Generator().manual_seed(start_pos)
    xq = torch.randn(2, seqlen, 4, head_dim, generator=generator)
    xk = torch.randn(2, seqlen, 2, head_dim, generator=generator)
    table = precompute_freqs_cis(head_dim, 2 * 4096, theta)

    q, k = apply_rotary_emb(xq, xk, table[start_pos : start_pos + seqlen])

    positions = torch.arange(start_pos, start_pos + seqlen)
    freqs = rope_frequencies(head_dim, theta)
    # float32 angles lose about one ulp of position * frequency, so allow more at far positions.
    atol = 1e-5 + 2e-7 * (start_pos + seqlen)
    torch.testing.assert_close(q, rope_rotate_half(xq, positions, freqs), rtol=0, atol=atol)
    torch.testing.assert_close(k, rope_rotate_half(xk, positions, freqs), rtol=0, atol=atol)
    assert q.dtype == xq.dtype and k.dtype == xk.dtype


def test_rope_keeps_input_dtype():
    generator = torch.Generator().manual_seed(12)
    xq = torch.randn(1, 3, 2, 8, generator=generator).to(torch.bfloat16)
    xk = torch.randn(1, 3, 1, 8, generator=generator).to(torch.bfloat16)
    q, k = apply_rotary_emb(xq, xk, precompute_freqs_cis(8, 16, 500000.0)[5:8])
    assert (q.dtype, k.dtype) == (torch.bfloat16, torch.bfloat16)
    expected = rope_rotate_half(xq.float(), torch.arange(5, 8), rope_frequencies(8, 500000.0))
    torch.testing.assert_close(q.float(), expected, rtol=1e-2, atol=1e-2)


# 2. Attention with the KV cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 2), (4, None)], ids=["gqa", "mha"])
def test_attention_matches_reference_math_through_prefill_and_decode(process_group, n_heads, n_kv_heads):
    dim, bsz, max_seq_len = 64, 2, 32
    args = ModelArgs(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, max_batch_size=bsz, max_seq_len=max_seq_len)
    head_dim, kv_heads = dim // n_heads, n_kv_heads or n_heads
    generator = torch.Generator().manual_seed(1)
    weights = {
        "wq.weight": torch.randn(n_heads * head_dim, dim, generator=generator) / dim**0.5,
        "wk.weight": torch.randn(kv_heads * head_dim, dim, generator=generator) / dim**0.5,
        "wv.weight": torch.randn(kv_heads * head_dim, dim, generator=generator) / dim**0.5,
        "wo.weight": torch.randn(dim, n_heads * head_dim, generator=generator) / dim**0.5,
    }
    attention = Attention(args)
    attention.load_state_dict(weights, strict=True)
    x = torch.randn(bsz, 12, dim, generator=generator)
    freqs_cis = precompute_freqs_cis(head_dim, 2 * max_seq_len, args.rope_theta)

    # Ours, as the Transformer drives it: a prefill, a second chunk on top of the cache, then single tokens.
    outputs, start_pos = [], 0
    with torch.no_grad():
        for size in [5, 3, 1, 1, 1, 1]:
            mask = causal_mask(size, start_pos) if size > 1 else None
            chunk = x[:, start_pos : start_pos + size]
            outputs.append(attention(chunk, start_pos, freqs_cis[start_pos : start_pos + size], mask))
            start_pos += size
    ours = torch.cat(outputs, dim=1)

    # Reference: Meta's attention math over the whole sequence at once, with rotate-half RoPE.
    positions = torch.arange(12)
    freqs = rope_frequencies(head_dim, args.rope_theta)
    q = rope_rotate_half((x @ weights["wq.weight"].T).view(bsz, 12, n_heads, head_dim), positions, freqs)
    k = rope_rotate_half((x @ weights["wk.weight"].T).view(bsz, 12, kv_heads, head_dim), positions, freqs)
    v = (x @ weights["wv.weight"].T).view(bsz, 12, kv_heads, head_dim)
    expected = reference_attention(q, k, v, causal_mask(12, 0), n_heads // kv_heads) @ weights["wo.weight"].T

    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


# 3. The whole model against Hugging Face transformers ----------------------------------------------------------


@pytest.mark.parametrize("params", [GQA_PARAMS, MHA_PARAMS], ids=["gqa", "mha"])
def test_logits_match_transformers(process_group, params):
    args = ModelArgs(**params, max_seq_len=32, max_batch_size=2)
    meta = random_weights(params, seed=3, dtype=torch.float32)
    ours, hf = our_model(meta, args), hf_model(meta, args)
    tokens = torch.randint(0, params["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(4))

    expected = hf_logits(hf, tokens)
    assert expected.abs().max() > 1  # logits large enough that a wrong model could not pass by being tiny

    full = ours(tokens, 0)
    assert full.dtype == torch.float32 and full.shape == (2, 16, params["vocab_size"])
    assert (full - expected).abs().max() < ATOL

    # The KV cache: a prefill, a chunk on top of it, then one token at a time, must give the same logits.
    cached = incremental_logits(ours, tokens, [6, 4, 1, 1, 1, 1, 1, 1])
    assert (cached - expected).abs().max() < ATOL

    # The speed-up generation uses when it needs no logprobs: logits for the last position only, with the last
    # layer's feed-forward run on that position alone. Every position's keys and values are still cached: the
    # tokens after such a prompt get the same logits.
    ours.init_kv_caches()  # zeroed, so that nothing the passes above cached stands in for this one's
    last = ours(tokens[:, :10], 0, last_logits_only=True)
    assert last.shape == (2, 1, params["vocab_size"])
    assert (last - expected[:, 9:10]).abs().max() < ATOL
    assert torch.equal(last.argmax(-1), expected[:, 9:10].argmax(-1))
    assert (ours(tokens[:, 10:], 10) - expected[:, 10:]).abs().max() < ATOL


# 4. Scaled RoPE (Llama 3.1 and later) -------------------------------------------------------------------------


def frequencies_of(freqs_cis: torch.Tensor) -> torch.Tensor:
    """The frequencies a RoPE table was built from: the angles of its position-1 row (all below pi)."""
    return torch.angle(freqs_cis[1]).double()


def test_rope_table_is_polar_of_positions_times_frequencies():
    table = precompute_freqs_cis(128, 64, 500000.0)
    assert table.dtype == torch.complex64 and table.shape == (64, 64)
    freqs = torch.tensor(rope_frequencies(128, 500000.0))
    angles = torch.arange(64, dtype=torch.float64)[:, None] * freqs[None, :]
    torch.testing.assert_close(table.abs(), torch.ones(64, 64), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.view_as_real(table).double(), torch.stack([angles.cos(), angles.sin()], -1), rtol=0, atol=1e-4
    )


@pytest.mark.parametrize("factor", [None, 8.0, 32.0])
def test_scaled_rope_frequencies_follow_the_llama31_rule(factor):
    head_dim, theta = 128, 500000.0  # Llama 3.1 8B
    plain = rope_frequencies(head_dim, theta)
    expected = torch.tensor(llama31_scaled_frequencies(head_dim, theta, factor or 8.0), dtype=torch.float64)
    wavelengths = [2 * math.pi / f for f in plain]
    # The check covers all three bands: kept, blended and divided frequencies.
    assert min(wavelengths) < 2048 and max(wavelengths) > 8192 and any(2048 < w < 8192 for w in wavelengths)

    got = frequencies_of(precompute_freqs_cis(head_dim, 4, theta, use_scaled=True, scale_factor=factor))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    unscaled = frequencies_of(precompute_freqs_cis(head_dim, 4, theta))
    torch.testing.assert_close(unscaled, torch.tensor(plain, dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_scaled_rope_matches_transformers_llama3_rope(process_group, factor):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # Llama 3.2 1B shapes (head_dim 64); rope_scaling_factor None means the Llama 3.1 factor 8.
    args = ModelArgs(
        dim=128,
        n_layers=1,
        n_heads=2,
        vocab_size=8,
        rope_theta=500000.0,
        max_seq_len=4,
        max_batch_size=1,
        use_scaled_rope=True,
        rope_scaling_factor=None if factor == 8.0 else factor,
    )
    config = transformers.LlamaConfig(
        hidden_size=args.dim,
        num_attention_heads=args.n_heads,
        max_position_embeddings=131072,
        rope_parameters={**HF_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": factor},
    )
    hf_freqs, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    assert attention_scaling == 1.0
    ours = frequencies_of(Transformer(args).rope_table())
    torch.testing.assert_close(ours, hf_freqs.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_long_context_logits_match_transformers_beyond_8192(process_group, factor):
    params = {**GQA_PARAMS, "dim": 32, "n_layers": 1, "vocab_size": 256, "use_scaled_rope": True}
    if factor != 8.0:
        params["rope_scaling_factor"] = factor
    args = ModelArgs(**params, max_seq_len=8320, max_batch_size=1)
    seqlen = 8256
    meta = random_weights(params, seed=5, dtype=torch.float32)
    rope = {**HF_LLAMA3_ROPE, "factor": factor}
    # SDPA rather than eager attention: the same math without an (8256 x 8256) score matrix per head.
    hf = hf_model(meta, args, rope=rope, attn="sdpa")
    tokens = torch.randint(0, 256, (1, seqlen), generator=torch.Generator().manual_seed(6))
    expected = hf_logits(hf, tokens)

    # Ours: a long prefill in chunks through the KV cache, then single tokens across position 8192.
    ours = incremental_logits(our_model(meta, args), tokens, [4096, 4000, 96] + [1] * 64)
    assert (ours - expected).abs().max() < ATOL
    assert (ours[:, 8192:] - expected[:, 8192:]).abs().max() < ATOL  # the positions Llama 3 never saw


# 5. A tied output head, through the checkpoint loader ---------------------------------------------------------


def test_tied_output_head_matches_transformers(process_group, tmp_path):
    params = GQA_PARAMS
    meta = random_weights(params, seed=7, dtype=torch.float32)
    del meta["output.weight"]  # Llama 3.2 1B/3B tie the head to the embedding
    write_meta_checkpoint(tmp_path / "tied", params, meta)

    reader = open_checkpoint(tmp_path / "tied")
    args, ignored = model_args_from(reader.params, max_seq_len=32, max_batch_size=2)
    assert ignored == []
    ours = load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32)
    hf = hf_model(meta, args, tie=True)
    tokens = torch.randint(0, params["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(8))

    expected = hf_logits(hf, tokens)
    assert (ours(tokens, 0) - expected).abs().max() < ATOL
    # load_model builds on the meta device, so also decode through the KV caches it allocated.
    assert (incremental_logits(ours, tokens, [4, 3, 1, 1, 1]) - expected).abs().max() < ATOL


# 6. RMSNorm precision and the SwiGLU width ---------------------------------------------------------------------


def test_rmsnorm_computes_in_float32_and_casts_back():
    dim, eps = 64, 1e-5
    generator = torch.Generator().manual_seed(9)
    x = (3 * torch.randn(8, dim, generator=generator)).to(torch.bfloat16)
    norm = RMSNorm(dim, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=generator))

    # Normalise in float32, round to bf16, then multiply by the bf16 weight (in bf16).
    x32 = x.float()
    normalised = (x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    expected = normalised * norm.weight.detach()
    with torch.no_grad():
        got = norm(x)

    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0.02)  # rsqrt vs 1/sqrt: at most one bf16 ulp apart
    assert (got != expected).float().mean() < 0.05
    # The input is such that precision matters: normalising in bf16 gives a visibly different result.
    in_bf16 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.detach()
    assert (in_bf16 != expected).float().mean() > 4 * (got != expected).float().mean()


def test_rmsnorm_float32_formula():
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(10))
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
        got = norm(x)
    expected = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dim, multiple_of, multiplier, published",
    [
        (4096, 1024, 1.3, 14336),  # Llama 3 8B
        (8192, 4096, 1.3, 28672),  # Llama 3 70B
        (16384, 4096, 1.2, 53248),  # Llama 3.1 405B
        (2048, 256, 1.5, 8192),  # Llama 3.2 1B
        (3072, 256, 1.0, 8192),  # Llama 3.2 3B
    ],
)
def test_feed_forward_width_matches_published_models(dim, multiple_of, multiplier, published):
    assert FeedForward.hidden_size(4 * dim, multiple_of, multiplier) == published


def test_feed_forward_is_swiglu(process_group):
    dim = 32
    ffn = FeedForward(dim, 4 * dim, multiple_of=16, ffn_dim_multiplier=None)
    hidden = ffn.w1.weight.shape[0]
    assert hidden == 96  # int(2 * 128 / 3) = 85, rounded up to a multiple of 16
    generator = torch.Generator().manual_seed(11)
    w1, w3 = torch.randn(hidden, dim, generator=generator), torch.randn(hidden, dim, generator=generator)
    w2 = torch.randn(dim, hidden, generator=generator)
    ffn.load_state_dict({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3}, strict=True)
    x = torch.randn(4, dim, generator=generator)
    gate = x @ w1.T
    expected = (gate * torch.sigmoid(gate) * (x @ w3.T)) @ w2.T
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-4)


def test_model_args_defaults_are_llama3_8b_shaped():
    args = ModelArgs()
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (4096, 32, 32, None)
    assert (args.vocab_size, args.multiple_of, args.ffn_dim_multiplier, args.norm_eps) == (-1, 256, None, 1e-5)
    assert (args.rope_theta, args.max_batch_size, args.max_seq_len) == (500000, 32, 2048)


# 7. Speed-ups keep the reference math ----------------------------------------------------------------------


def load_tiny(tmp_path, weights, dtype):
    write_meta_checkpoint(tmp_path / "ckpt", GQA_PARAMS, weights)
    reader = open_checkpoint(tmp_path / "ckpt")
    args = model_args_from(reader.params, max_seq_len=32, max_batch_size=2)[0]
    return load_model(reader, args, 0, 1, torch.device("cpu"), dtype)


def reference_model(tmp_path, weights, dtype) -> Transformer:
    """The same checkpoint as `load_tiny` gives, run as Meta's code runs it: `F.linear`, attention step by step."""
    model = load_tiny(tmp_path, weights, dtype)
    unpack_layers(model)
    return with_reference_attention(model)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fast_path_gives_the_reference_logits_in_float32(process_group, tmp_path, tie):
    """Fused attention and the CPU linear layers keep float32 logits within 1e-4 of Meta's math."""
    params = GQA_PARAMS
    weights = random_weights(params, seed=11)
    if tie:
        del weights["output.weight"]
    loaded = load_tiny(tmp_path / "fast", weights, torch.float32)
    layers = [m for m in loaded.modules() if isinstance(m, CPULinear)]
    assert len(layers) == 7 * params["n_layers"] + 1
    if tie:
        assert loaded.output.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()  # one table, not two
        weights["output.weight"] = weights["tok_embeddings.weight"]
    weights = {k: v.float() for k, v in weights.items()}
    assert {k: v.shape for k, v in loaded.state_dict().items()} == {k: v.shape for k, v in weights.items()}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())  # the ordinary layout
    reference = reference_model(tmp_path / "reference", weights, torch.float32)
    assert not any(isinstance(m, CPULinear) for m in reference.modules())

    tokens = torch.randint(0, params["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    expected = reference(tokens, 0)
    assert expected.abs().max() > 1  # logits large enough that a wrong model could not pass by being tiny
    assert (loaded(tokens, 0) - expected).abs().max() < ATOL
    steps = incremental_logits(loaded, tokens, [8, 1, 1, 1, 1])
    assert (steps - expected).abs().max() < ATOL
    assert torch.equal(steps.argmax(-1), expected.argmax(-1))
    one_row = incremental_logits(loaded, tokens[:1], [8, 1, 1, 1, 1])  # batch 1 decodes one row at a time
    assert (one_row - expected[:1]).abs().max() < ATOL


def greedy_tokens(model: Transformer, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt
    logits = model(tokens, 0)[:, -1]
    for _ in range(steps):
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        logits = model(tokens[:, -1:], tokens.shape[1] - 1)[:, -1]
    return tokens[:, prompt.shape[1] :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fast_path_keeps_greedy_tokens_and_torch_settings(process_group, tmp_path, dtype):
    weights = random_weights(GQA_PARAMS, seed=12)
    fast = load_tiny(tmp_path / "fast", weights, dtype)
    reference = reference_model(tmp_path / "reference", weights, dtype)
    prompt = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    onednn_enabled = torch.backends.mkldnn.enabled
    for batch in (prompt, prompt[:1]):  # batch 1 takes the matrix-vector kernels
        assert torch.equal(greedy_tokens(fast, batch, 20), greedy_tokens(reference, batch, 20))
    # A bfloat16 row switches oneDNN off for its own matmul only: the global switch is as the user left it.
    assert torch.backends.mkldnn.enabled == onednn_enabled
    # The weights are the checkpoint's, in the ordinary layout: state_dict() and editing work as usual.
    expected = reference.state_dict()
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prompt_attended_causally_equals_the_mask_tensor_bit_for_bit(process_group, tmp_path, dtype):
    """A prompt from position 0 goes through SDPA's is_causal; the reference's mask tensor gives the same bits."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=16), dtype)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(8))
    causal = model(tokens, 0)
    with torch.inference_mode():
        h = model.tok_embeddings(tokens)
        mask = causal_mask(tokens.shape[1], 0).to(dtype)
        for layer in model.layers:
            h = layer(h, 0, model.freqs_cis[: tokens.shape[1]], mask)
        masked = model.output(model.norm(h)).float()
    assert torch.equal(causal, masked)


def test_batched_bfloat16_steps_on_packed_weights_follow_weight_edits(process_group, tmp_path):
    """Prompts and decode steps of several bf16 sequences run on weights packed once for oneDNN: the logits of
    `F.linear` bit for bit, also after a weight is edited in place or replaced between calls."""
    weights = random_weights(GQA_PARAMS, seed=15)
    packed = load_tiny(tmp_path / "packed", weights, torch.bfloat16)
    plain = load_tiny(tmp_path / "plain", weights, torch.bfloat16)
    unpack_layers(plain)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(7))

    def steps(model):
        return incremental_logits(model, tokens, [6, 1, 1, 1, 1])

    before = steps(packed)
    assert torch.equal(before, steps(plain))
    assert all(m.packed is not None for m in packed.modules() if isinstance(m, CPULinear))

    with torch.no_grad():
        for model in (packed, plain):
            model.layers[1].feed_forward.w2.weight.mul_(-1)
    after = steps(packed)
    assert not torch.equal(after, before)
    assert torch.equal(after, steps(plain))

    # A replaced weight, made to have the old one's version count: only its identity tells it apart.
    output = torch.randn_like(plain.output.weight)
    while output._version < packed.output.weight._version:
        output.add_(0)
    packed.output.weight, plain.output.weight = nn.Parameter(output), nn.Parameter(output.clone())
    assert torch.equal(steps(packed), steps(plain))

    # The packed copies are dropped from copies of the model (they cannot be copied), and remade there.
    assert torch.equal(steps(copy.deepcopy(packed)), steps(plain))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_layers_compute_what_fairscale_layers_do(process_group, tmp_path, dtype):
    """The layers a loaded model runs on (`llama.parallel_layers`, as on a GPU) give fairscale's logits bit for bit,
    under the same state-dict keys."""
    weights = random_weights(GQA_PARAMS, seed=17)
    model = load_tiny(tmp_path / "ckpt", weights, dtype)
    assert isinstance(model.tok_embeddings, ParallelEmbedding)
    unpack_layers(model)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(9))
    expected = incremental_logits(model, tokens, [6, 1, 1, 1, 1])
    keys = model.state_dict().keys()
    use_parallel_layers(model)
    assert isinstance(model.layers[1].attention.wo, ParallelLinear)
    assert model.state_dict().keys() == keys
    assert torch.equal(incremental_logits(model, tokens, [6, 1, 1, 1, 1]), expected)


def test_no_packed_copies_without_memory_for_them(process_group, tmp_path, monkeypatch):
    """A second copy of the weights is made only when the system has twice their size available."""
    monkeypatch.setattr(llama.cpu, "available_memory", lambda: 0)
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=15), torch.bfloat16)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))
    incremental_logits(model, tokens, [6, 1, 1])
    assert all(m.packed is None for m in model.modules() if isinstance(m, CPULinear))


# 8. The static-shape decode step, eager and compiled ------------------------------------------------------------


def static_steps(step, model: Transformer, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits for positions prompt_len.. of `tokens`: the prompt through `forward`, then one `step` per token."""
    logits = [model(tokens[:, :prompt_len], 0)[:, -1:]]
    for pos in range(prompt_len, tokens.shape[1] - 1):
        logits.append(step(tokens[:, pos : pos + 1], torch.tensor([pos])))
    return torch.cat(logits, dim=1)


def test_decode_step_gives_the_logits_of_forward_and_ignores_stale_cache(process_group, tmp_path):
    """decode_step attends over the whole cache; what an earlier, longer sequence left there must not count."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=13), torch.float32)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=generator)
    expected = model(tokens, 0)[:, 5:-1]
    model(torch.randint(0, GQA_PARAMS["vocab_size"], (2, 32), generator=generator), 0)  # fills the whole cache
    got = static_steps(model.decode_step, model, tokens, prompt_len=6)
    assert expected.abs().max() > 1
    assert (got - expected).abs().max() < ATOL


def assert_same_completions(got, expected):
    """The same text_completion texts, and logprobs apart by float32 rounding only."""
    assert [c["generation"] for c in got] == [c["generation"] for c in expected]
    for a, b in zip(got, expected):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < ATOL


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_decoding_keeps_greedy_tokens(tiny_checkpoint, tokenizer_path, process_group, device):
    """Llama.build(compile=True) decodes through torch.compile (on CUDA, CUDA graphs); float32 tokens stay those of
    the eager path."""
    from llama import Llama

    generator = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=48, max_batch_size=2, device=device, dtype="float32"
    )
    prompts = ["The capital of France is", "1, 2, 3,"]
    eager = generator.text_completion(prompts, temperature=0, max_gen_len=16, logprobs=True)
    counters.clear()
    generator.compile_decode_step()
    compiled = generator.text_completion(prompts, temperature=0, max_gen_len=16, logprobs=True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # the whole step, compiled
    assert counters["inductor"]["cudagraph_skips"] == 0  # on CUDA, replayed as a CUDA graph
    assert_same_completions(compiled, eager)
    counters.clear()
    generator.text_completion(["Prompts of other lengths", "and another length of output"], max_gen_len=9)
    assert counters["stats"]["unique_graphs"] == 0  # the same compiled step, not compiled again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_decodes_the_tokens_of_the_cpu(tiny_checkpoint, tokenizer_path, process_group):
    """The eager path on a GPU (the reference's device) gives the float32 tokens and logprobs of the CPU path,
    which the other tests check against the reference math."""
    from llama import Llama

    prompts = ["The capital of France is", "1, 2, 3,"]
    completions = {}
    for device in ("cpu", "cuda"):
        generator = Llama.build(
            str(tiny_checkpoint), tokenizer_path, max_seq_len=48, max_batch_size=2, device=device, dtype="float32"
        )
        completions[device] = generator.text_completion(prompts, temperature=0, max_gen_len=16, logprobs=True)
    assert_same_completions(completions["cuda"], completions["cpu"])


def test_compiled_step_is_one_graph_with_fairscale_layers(process_group, tmp_path):
    """A model put back on fairscale's layers (whose all-reduce torch.compile cannot trace) still compiles to one
    graph (one CUDA graph): compiling swaps in `llama.parallel_layers`, with the same weights and logits."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=16), torch.float32)
    unpack_layers(model)  # fairscale's layers, as in Meta's code
    weights = model.state_dict()
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(8))
    expected = static_steps(model.decode_step, model, tokens, prompt_len=6)
    counters.clear()
    got = static_steps(compiled_decode_step(model), model, tokens, prompt_len=6)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert expected.abs().max() > 1
    assert (got - expected).abs().max() < ATOL
    assert isinstance(model.layers[0].feed_forward.w2, ParallelLinear)
    assert {key: tensor.data_ptr() for key, tensor in model.state_dict().items()} == {
        key: tensor.data_ptr() for key, tensor in weights.items()
    }


def test_compiled_bfloat16_step_rounds_like_the_eager_path(process_group, tmp_path):
    """In bfloat16 fused kernels round differently, so compare step by step on the same tokens: the same argmax,
    and logits apart by bfloat16 rounding only (its step is 1/128 of a value)."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=14), torch.bfloat16)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(6))
    expected = model(tokens, 0)[:, 5:-1]
    step = compiled_decode_step(model)
    got = static_steps(step, model, tokens, prompt_len=6)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()
