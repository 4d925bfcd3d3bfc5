"""What choosing the CPU kernels by measuring costs at load, and what it chose.

    python benchmarks/kernel_choice.py                     # Llama 3.2 1B's shape, float32 and bfloat16
    python benchmarks/kernel_choice.py --shapes d256 1b --loads 3

For each shape and dtype, in fresh processes on the same checkpoint (bench.py's random weights): `Llama.build`
with an empty kernel cache (the kernels are measured), then with the cache that load wrote (they are not), `--loads`
times each, alternating. It prints the load times, the measuring time `llama.runtime.cpu` logs, its share of the cold
load, and each product's kernels. The CPU's name and flags come first: the choice is this CPU's.
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
from bench import default_tokenizer, meta_checkpoint  # noqa: E402


def worker(checkpoint: str, dtype: str) -> None:
    """One load, printing a JSON line: seconds, measuring seconds, and the choices logged."""
    import torch

    from llama import Llama

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("llama.runtime.cpu").addHandler(handler)
    logging.getLogger("llama.runtime.cpu").setLevel(logging.INFO)
    torch.set_num_threads(os.cpu_count())
    start = time.perf_counter()
    Llama.build(checkpoint, max_seq_len=1024, max_batch_size=8, device="cpu", dtype=dtype)
    load_s = time.perf_counter() - start
    chosen = next(m for m in records if m.startswith("CPU kernels chosen"))
    measuring_s = float(re.search(r"in ([0-9.]+) s", chosen).group(1))
    print(json.dumps({"load_s": load_s, "measuring_s": measuring_s, "log": records}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1b"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--loads", type=int, default=2, help="cold and warm loads each")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    from llama.runtime.cpu import cpu_flags, cpu_name, instruction_caps

    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags() + instruction_caps())}")
    for shape in args.shapes:
        checkpoint = meta_checkpoint(shape, args.workdir, default_tokenizer(), "cpu")
        for dtype in args.dtypes:
            runs = {"cold": [], "warm": []}
            for _ in range(args.loads):
                with tempfile.TemporaryDirectory() as cache:
                    for kind in runs:  # cold: an empty cache; warm: the one the cold load wrote
                        env = {**os.environ, "XDG_CACHE_HOME": cache}
                        env.pop("LLAMA_CPU_KERNEL", None)
                        command = [sys.executable, __file__, "--worker", str(checkpoint), dtype]
                        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                        runs[kind].append(json.loads(out.strip().splitlines()[-1]))
            cold, warm = (statistics.median(r["load_s"] for r in runs[kind]) for kind in ("cold", "warm"))
            measuring = [r["measuring_s"] for r in runs["cold"]]
            shares = [r["measuring_s"] / r["load_s"] for r in runs["cold"]]
            print(
                f"{shape} {dtype}: load {cold:.2f} s measuring, {warm:.2f} s from the cache (medians of {args.loads}); "
                f"measuring {statistics.median(measuring):.2f} s ({min(measuring):.2f} to {max(measuring):.2f}), "
                f"{statistics.median(shares):.1%} of the load ({min(shares):.1%} to {max(shares):.1%})"
            )
            for message in runs["cold"][-1]["log"]:
                print("   ", message)


if __name__ == "__main__":
    main()
