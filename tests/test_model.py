"""Cross-checks of llama/model.py against independent implementations, on tiny random float32 weights (CPU).

The references are written here from the published formulas (rotate-half RoPE, the Llama 3.1 frequency
scaling, RMSNorm), or taken from other code bases: `torch.nn.functional.scaled_dot_product_attention` for
attention and Hugging Face `transformers.LlamaForCausalLM` for the whole model. The Meta -> Hugging Face
weight conversion is written here too, so that a mistake in llama/checkpoint/ cannot hide one in the model.
"""

import math

import pytest
import torch
from helpers import ATOL, GQA_PARAMS, causal_mask, import_or_skip, incremental_logits, reference_attention

from llama.checkpoint import load_model, model_args_from, open_checkpoint, random_weights, write_meta_checkpoint
from llama.model import (
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    apply_rotary_emb,
    precompute_freqs_cis,
)
from llama.runtime import RuntimeTransformer

transformers = import_or_skip("transformers", 'pip install -e ".[test]"')

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
    """The Llama 3.1 RoPE scaling rule (Meta's `apply_scaling`), one frequency at a time.

    Constants: scale factor 8 (Llama 3.1; 32 for Llama 3.2 1B/3B), low_freq_factor 1, high_freq_factor 4,
    original context 8192. A frequency f of wavelength w = 2 pi / f is kept if w < 8192 / 4, divided by the
    factor if w > 8192 / 1, and otherwise blended: (1 - s) * f / factor + s * f with s = (8192 / w - 1) / (4 - 1).
    """
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
    ours = RuntimeTransformer(ours)  # the same modules, as the runtime runs them
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


@pytest.mark.slow
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
