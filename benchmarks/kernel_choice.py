"""What choosing the CPU kernels by measuring costs at load, and what it chose.

    python benchmarks/kernel_choice.py                     # Llama 3.2 1B's shape, float32 and bfloat16
    python benchmarks/kernel_choice.py --shapes d256 1b --loads 3
    python benchmarks/kernel_choice.py --dtypes bfloat16 --against-sample 22 --loads 3   # the decode sample's size

For each shape and dtype, in fresh processes on the same checkpoint (bench.py's random weights): `Llama.build`
with an empty kernel cache (the kernels are measured), then with the cache that load wrote (they are not), `--loads`
times each, alternating. It prints the load times, the measuring time `llama.runtime.cpu` logs, its share of the cold
load, each product's kernels, and batch-1 decode tokens/s on what the cold load chose (greedy, 32 steps after
bench.py's 16-token prompt, the prompt's own time subtracted). The CPU's name and flags come first: the choice is
this CPU's.

`--against-sample E` alternates each cold load with one whose one-row and batch timings take samples of 2**E
weights (`llama.runtime.cpu.choice.DECODE_SAMPLE_VALUES` set so in that process), and prints both loads' decode
figures and kernels: what the sample's size changes in the choice, and in decoding.
"""

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import DECODE_PROMPT, default_tokenizer, meta_checkpoint, timed  # noqa: E402

DECODE_STEPS = 32


def worker(checkpoint: str, dtype: str, sample_exponent: str) -> None:
    """One load, printing a JSON line: seconds, measuring seconds, the choices logged, the load report's kernels
    line and batch-1 decode tokens/s. `sample_exponent`: 2**it weights per decode sample, or "" for the library's."""
    import torch

    import llama.runtime.cpu.choice
    from llama import Llama

    if sample_exponent:
        llama.runtime.cpu.choice.DECODE_SAMPLE_VALUES = 2 ** int(sample_exponent)

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("llama.runtime.cpu").addHandler(handler)
    logging.getLogger("llama.runtime.cpu").setLevel(logging.INFO)
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    generator = Llama.build(checkpoint, max_seq_len=1024, max_batch_size=8, device="cpu", dtype=dtype)
    load_s = time.perf_counter() - start
    chosen = next(m for m in records if m.startswith("CPU kernels chosen"))
    measuring_s = float(re.search(r"in ([0-9.]+) s", chosen).group(1))
    generator.tokenizer.stop_tokens = set()  # random weights: decode for exactly the steps asked

    def decode(steps: int) -> float:
        return timed(lambda: generator.generate([DECODE_PROMPT], steps, temperature=0), "cpu", 2)

    decode(2)  # a warm-up
    tokens_per_s = DECODE_STEPS / (decode(DECODE_STEPS + 1) - decode(1))
    kernels = str(generator.load_report).splitlines()[-1]
    report = {"load_s": load_s, "measuring_s": measuring_s, "log": records, "kernels": kernels}
    print(json.dumps({**report, "decode_tokens_per_s": tokens_per_s}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1b"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--loads", type=int, default=2, help="cold and warm loads each")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--against-sample", type=int, help="also cold loads with decode samples of 2**E weights")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    from llama.runtime.cpu import cpu_flags, cpu_name, instruction_caps

    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags() + instruction_caps())}")
    for shape in args.shapes:
        checkpoint = meta_checkpoint(shape, args.workdir, default_tokenizer(), "cpu")
        for dtype in args.dtypes:
            runs = {"cold": [], "warm": [], "other sample": []}
            for load in range(args.loads):
                # cold: an empty cache; warm: the one the cold load wrote; then, or first in every other load, a
                # cold load with decode samples of 2**E weights (an empty cache of its own)
                kinds = ["cold", "warm"]
                if args.against_sample:
                    kinds = kinds + ["other sample"] if load % 2 else ["other sample"] + kinds
                with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as other_cache:
                    for kind in kinds:
                        if kind == "other sample":
                            runs[kind].append(load_once(checkpoint, dtype, other_cache, str(args.against_sample)))
                        else:
                            runs[kind].append(load_once(checkpoint, dtype, cache, ""))
            cold, warm = (statistics.median(r["load_s"] for r in runs[kind]) for kind in ("cold", "warm"))
            measuring = [r["measuring_s"] for r in runs["cold"]]
            shares = [r["measuring_s"] / r["load_s"] for r in runs["cold"]]
            print(
                f"{shape} {dtype}: load {cold:.2f} s measuring, {warm:.2f} s from the cache (medians of {args.loads}); "
                f"measuring {statistics.median(measuring):.2f} s ({min(measuring):.2f} to {max(measuring):.2f}), "
                f"{statistics.median(shares):.1%} of the load ({min(shares):.1%} to {max(shares):.1%})"
            )
            for kind in ("cold", "other sample"):
                if runs[kind]:
                    decode = [r["decode_tokens_per_s"] for r in runs[kind]]
                    sample = f"samples of 2**{args.against_sample}" if kind != "cold" else "the library's samples"
                    figures = ", ".join(f"{d:.2f}" for d in decode)
                    measuring = statistics.median(r["measuring_s"] for r in runs[kind])
                    print(
                        f"  {sample}: decode {statistics.median(decode):.2f} tokens/s (loads: {figures}), "
                        f"measuring {measuring:.2f} s"
                    )
                    for r in runs[kind]:
                        print("   ", r["kernels"])
            for message in runs["cold"][-1]["log"]:
                print("   ", message)


def load_once(checkpoint: Path, dtype: str, cache: str, sample_exponent: str) -> dict:
    """One `worker` in a fresh process with the kernel cache in `cache`."""
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    env.pop("LLAMA_CPU_KERNEL", None)
    command = [sys.executable, __file__, "--worker", str(checkpoint), dtype, sample_exponent]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
