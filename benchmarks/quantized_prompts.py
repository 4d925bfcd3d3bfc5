"""A whole prompt's forward pass on the CPU, quantized and not: the figure issue 55's prompt target is set in (int8
and int4 prompts at least 0.8x bfloat16's at 64 and 512 tokens).

    python benchmarks/quantized_prompts.py                     # bfloat16, int8 and int4 at the 1B shape
    python benchmarks/quantized_prompts.py --schemes int8 --shape 1b

Each scheme loads in a process of its own (`Llama.build` of bench.py's random checkpoint of the shape, dtype
bfloat16, its kernels measured or read from the cache as any load does), then runs the forward pass of a random
prompt of each length three times, the logits of its last position only (as generation runs a prompt, and as
bench.py times it); printed: the median seconds and the range, and the load report's kernels line.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import default_tokenizer, meta_checkpoint  # noqa: E402

LENGTHS = (64, 512)
RUNS = 3


def worker(checkpoint: Path, scheme: str) -> dict:
    import torch

    from llama import Llama

    quantize = None if scheme == "bfloat16" else scheme
    build = dict(max_seq_len=max(LENGTHS) + 8, max_batch_size=1, quantize=quantize, dtype="bfloat16")
    generator = Llama.build(str(checkpoint), **build)
    seconds = {}
    with torch.inference_mode():
        for length in LENGTHS:
            tokens = torch.randint(1000, 100000, (1, length), generator=torch.Generator().manual_seed(length))
            runs = []
            for _ in range(RUNS):
                start = time.perf_counter()
                generator.model.forward(tokens, 0, last_logits_only=True)  # as generation runs a prompt
                runs.append(time.perf_counter() - start)
            seconds[length] = runs
    return {"seconds": seconds, "kernels": str(generator.load_report).splitlines()[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", help="a checkpoint shape of bench.py")
    parser.add_argument("--schemes", nargs="+", default=["bfloat16", "int8", "int4"])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        print(json.dumps(worker(opts.checkpoint, opts.worker)))
        return
    checkpoint = meta_checkpoint(opts.shape, opts.workdir, default_tokenizer(), "cpu")
    for scheme in opts.schemes:
        command = [sys.executable, __file__, "--worker", scheme, "--checkpoint", str(checkpoint)]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        found = json.loads(result.stdout.strip().splitlines()[-1])
        figures = "; ".join(
            f"{length} tokens {statistics.median(runs):.2f} s ({min(runs):.2f}-{max(runs):.2f})"
            for length, runs in found["seconds"].items()
        )
        print(f"{opts.shape} {scheme}: {figures}\n  {found['kernels']}")


if __name__ == "__main__":
    main()
