"""Decode and prompt speed of bfloat16, int8 and int4 weights on one CUDA GPU, in one process, on random weights
of a Llama 3 shape drawn on the GPU (no checkpoint file: an 8B one would take minutes to write and read).

    python benchmarks/cuda_quantized.py                      # Llama 3 8B's shape: bfloat16, int8, int4
    python benchmarks/cuda_quantized.py --schemes int8 --compile

Each model is built as `Llama.build` builds it (Meta's modules on the meta device, then its weights), quantized with
`llama.runtime.quantize_model` where asked, and made ready by `for_runtime` (the load column includes both), each
quantized product on the kernel the kernel table (`llama.runtime.kernel_table`) gives its weights and row count on
this GPU, printed per row class. Decode: batch 1, a 16-token prompt then `--steps` greedy tokens through the
decode step (CUDA graphs by default), the median of 3 runs, each with its range. Prompt: one forward pass of 512
tokens, the median of 3. The roofline is the measured device-to-device copy rate over the bytes a step must read
(every weight once, and the written part of the KV cache).
"""

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SHAPES, sync  # noqa: E402

from llama.checkpoint.load import AllocateOnMeta  # noqa: E402
from llama.checkpoint.shards import full_shapes  # noqa: E402
from llama.distributed import init_model_parallel  # noqa: E402
from llama.model import ModelArgs, Transformer  # noqa: E402
from llama.runtime import for_runtime, quantize_model  # noqa: E402
from llama.runtime.parallel_layers import kernels_in_use  # noqa: E402


def random_model(params: dict, max_seq_len: int, device: torch.device) -> Transformer:
    args = ModelArgs(**params, max_seq_len=max_seq_len, max_batch_size=1)
    with AllocateOnMeta():
        model = Transformer(args)
    generator = torch.Generator(device).manual_seed(0)
    weights = {}
    for key, shape in full_shapes(args).items():
        tensor = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        weights[key] = 1 + 0.1 * tensor if key.endswith("norm.weight") else tensor / shape[-1] ** 0.5
    model.load_state_dict(weights, strict=True, assign=True)
    model.init_kv_caches(device, torch.bfloat16)
    return model.eval()


def step_bytes(model, prompt_len: int) -> int:
    weights = sum(
        t.numel() * t.element_size() for name, t in model.state_dict().items() if "tok_embeddings" not in name
    )
    cache = model.layers[0].attention.kv_cache.cache_k
    per_position = 2 * cache[0, 0].numel() * cache.element_size() // cache.shape[1] * len(model.layers)
    return weights + per_position * prompt_len


def copy_rate(device) -> float:
    big = torch.empty(2**30, dtype=torch.uint8, device=device)
    big.clone()
    sync(device.type)
    start = time.perf_counter()
    for _ in range(10):
        big.clone()
    sync(device.type)
    return 2 * big.numel() * 10 / (time.perf_counter() - start)


def decode_rate(model, step, steps: int, device) -> float:
    tokens = torch.randint(0, 1000, (1, 16), device=device)
    logits = model(tokens, 0, last_logits_only=True)
    next_token = logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for position in range(16, 16 + steps):
        logits = step(next_token, torch.tensor([position], device=device))
        next_token = logits[:, -1].argmax(-1, keepdim=True)
    sync(device.type)
    return steps / (time.perf_counter() - start)


def prompt_rate(model, rows: int, device) -> float:
    tokens = torch.randint(0, 1000, (1, rows), device=device)
    model(tokens, 0, last_logits_only=True)
    sync(device.type)
    start = time.perf_counter()
    model(tokens, 0, last_logits_only=True)
    sync(device.type)
    return rows / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--schemes", nargs="+", default=["bfloat16", "int8", "int4"])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--device", default="cuda:0", help="cpu: to try the script on a small shape")
    parser.add_argument("--compile", action="store_true", help="decode through the compiled step")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    init_model_parallel(device, 1, timedelta(minutes=5))
    params = {k: v for k, v in SHAPES[opts.shape].items() if k != "tied"}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {opts.shape}", flush=True)
    results = []
    for scheme in opts.schemes:
        model = random_model(params, max_seq_len=opts.prompt + 64, device=device)
        start = time.perf_counter()
        if scheme != "bfloat16":
            quantize_model(model, scheme)
        model, step = for_runtime(model, compile=opts.compile, cuda_graphs=True)
        sync(device.type)
        load = time.perf_counter() - start
        step = step or model.decode_step
        kernels = kernels_in_use(model) or "F.linear"  # layers per kernel, in each row class
        decode = []
        for _ in range(3):
            decode.append(decode_rate(model, step, opts.steps, device))
            bandwidth = copy_rate(device)
        roofline = bandwidth / step_bytes(model, 16 + opts.steps // 2)
        prompts = [prompt_rate(model, opts.prompt, device) for _ in range(3)]
        row = (scheme, load, statistics.median(decode), min(decode), max(decode), roofline, statistics.median(prompts))
        results.append(row)
        decoded = f"decode {row[2]:.1f} tok/s ({row[3]:.1f}-{row[4]:.1f})"
        share = f"roofline {roofline:.0f} tok/s ({row[2] / roofline:.0%})"
        print(f"{scheme}: load {load:.1f} s, {decoded}, {share}, prompt {row[6]:.0f} tok/s; {kernels}", flush=True)
        del model, step
        torch.cuda.empty_cache()
    base = results[0]
    print(f"\n| weights | decode tok/s (range) | share of roofline | x {base[0]} | prompt {opts.prompt} tok/s | x |")
    for scheme, load, median, low, high, roofline, prompt in results:
        decoded = f"{median:.1f} ({low:.1f}-{high:.1f}) | {median / roofline:.0%} | {median / base[2]:.2f}"
        print(f"| {scheme} | {decoded} | {prompt:.0f} | {prompt / base[6]:.2f} |")


if __name__ == "__main__":
    main()
