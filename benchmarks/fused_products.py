"""What sharing one float16 copy gains (`llama.cpu.FusedProduct`: wq, wk, wv and w1, w3 run as one product each),
measured by switching it off and on in one process, on the same model, run after run.

    python benchmarks/fused_products.py                          # d256 and d1024, 6 pairs of runs
    python benchmarks/fused_products.py --shapes 1b --pairs 4

A shared machine's speed drifts from minute to minute by more than this gains, so two separate benchmark runs
cannot show it; here each pair runs both ways within seconds of each other (in alternating order), and the
median of the pairs' ratios is printed with their range. Only where bfloat16 runs on float16 copies (x86 CPUs
without oneDNN's bfloat16 kernels). Switched off, each layer makes its own copy at its first use.
Measured: decode tokens/s at batch 1 and 8 (greedy, prefill time subtracted, as bench.py) and prefill tokens/s
for prompts of 64 and 512 tokens.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import DECODE_PROMPT, default_tokenizer, meta_checkpoint, timed  # noqa: E402

from llama import Llama  # noqa: E402
from llama.cpu import CPULinear  # noqa: E402


def measure(generator: Llama, steps: int) -> dict:
    """tokens/s of each figure, once."""

    def decode(bsz: int, n: int) -> float:
        def generate(tokens):
            return timed(lambda: generator.generate([DECODE_PROMPT] * bsz, max_gen_len=tokens, temperature=0), "cpu", 1)

        return bsz * n / (generate(n + 1) - generate(1))

    def prefill(n: int) -> float:
        prompt = torch.randint(0, 128000, (1, n))
        return n / timed(lambda: generator.model.forward(prompt, 0, last_logits_only=True), "cpu", 1)

    return {"decode b1": decode(1, steps), "decode b8": decode(8, steps // 2), "prefill 64": prefill(64),
            "prefill 512": prefill(512)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["d256", "d1024"])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=16, help="batch-1 decode steps per run (batch 8: half)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    args = parser.parse_args()
    for shape in args.shapes:
        checkpoint = meta_checkpoint(shape, args.workdir, default_tokenizer(), "cpu")
        generator = Llama.build(str(checkpoint), max_seq_len=1024, max_batch_size=8, device="cpu", dtype="bfloat16")
        generator.tokenizer.stop_tokens = set()  # random weights: decode for exactly the steps asked
        layers = [m for m in generator.model.modules() if isinstance(m, CPULinear)]
        groups = {layer: layer.fused for layer in layers}
        if not any(groups.values()):
            sys.exit("No fused products here: bfloat16 runs on float16 copies only on x86 CPUs without oneDNN's "
                     "bfloat16 kernels (AVX2)")  # fmt: skip
        runs = {True: [], False: []}
        for pair in range(args.pairs + 1):  # the first pair warms up (and makes the separate copies)
            for fused in (True, False) if pair % 2 else (False, True):
                for layer in layers:
                    layer.fused = groups[layer] if fused else None
                figures = measure(generator, args.steps)
                if pair:
                    runs[fused].append(figures)
        print(f"{shape} bfloat16, {args.pairs} pairs: fused / separate, median (range)")
        for figure in runs[True][0]:
            ratios = [on[figure] / off[figure] for on, off in zip(runs[True], runs[False])]
            fused, separate = (statistics.median(r[figure] for r in runs[way]) for way in (True, False))
            print(f"  {figure}: {fused:.1f} / {separate:.1f} tok/s, "
                  f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}x to {max(ratios):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
