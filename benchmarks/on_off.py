"""What one CPU speed-up gains, measured by switching it off and on in one process, on the same model, run after
run.

    python benchmarks/on_off.py fused                          # d256 and d1024, 6 pairs of runs
    python benchmarks/on_off.py fused --shapes 1b --pairs 4
    python benchmarks/on_off.py measured-kernels --dtype float32 --against onednn --shapes d256 1b --pairs 3
    python benchmarks/on_off.py matmul-attention --shapes d1024 1b --pairs 3
    python benchmarks/on_off.py top-p-head --shapes d256 d1024 1b --pairs 4
    python benchmarks/on_off.py fp16-call --shapes d256 d512 d1024 --pairs 4

The speed-ups:
- fused: `llama.runtime.cpu.FusedProduct`, wq, wk, wv and w1, w3 each run as one product on one shared copy (only where
  products run on copies: float16 ones, or oneDNN's in bfloat16; where that kernel measured fastest, or
  LLAMA_CPU_KERNEL=fp16 / onednn pins it). Switched off, each layer makes its own copy at its first use.
- measured-kernels: each product on the kernels measured at load (`llama.runtime.cpu.choose_kernels`) rather than all
  on the `--against` kernel (default `F.linear`, what transformers runs; where that kernel cannot run a product,
  `F.linear`).
- matmul-attention: bfloat16 attention of one new position on float32 matmuls
  (`llama.runtime.cpu.one_position_attention`, from the cache length measured at load on:
  `llama.runtime.cpu.attention`) rather than SDPA's bfloat16 kernel.
  Switched off, SDPA attends at every length.
- fp16-call: fbgemm's products called with torch functions of tensor subclasses switched off
  (`llama.runtime.cpu.fp16_products`), which skips a failed `__torch_function__` lookup on the packed weight at each
  call; only where weights run on float16 copies. Switched off, the op is called as it is elsewhere.
- top-p-head: nucleus sampling ranks only the most likely tokens of each row (`llama.decoding.sampling.nucleus_head`)
  rather than sorting the whole vocabulary; only sampled decoding uses it.
- greedy-numpy: greedy decoding picks the most likely token with numpy's argmax (`llama.decoding.sampling.greedy_pick`)
  rather than torch's.

A shared machine's speed drifts from minute to minute by more than these gains, so two separate benchmark runs
cannot show it; here each pair runs both ways within seconds of each other (in alternating order), and the
median of the pairs' ratios is printed with their range. Measured: decode tokens/s at batch 1 and 8 (greedy,
prefill time subtracted, as bench.py), the same at batch 1 sampled as the examples sample (temperature 0.6, top_p
0.9), prefill tokens/s for prompts of 64 and 512 tokens, and tokens/s of the model's batch-1 decode steps after a
prompt of LONG_PROMPT tokens.
"""

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import DECODE_PROMPT, default_tokenizer, meta_checkpoint, timed  # noqa: E402

import llama.decoding.sampling  # noqa: E402
import llama.runtime.cpu  # noqa: E402
from llama import Llama  # noqa: E402
from llama.decoding.sampling import greedy_pick  # noqa: E402
from llama.runtime.cpu import CPULinear  # noqa: E402

LONG_PROMPT = 600  # tokens before the decode steps of the last figure


def measure(generator: Llama, steps: int) -> dict:
    """tokens/s of each figure, once."""

    def decode(bsz: int, n: int, temperature: float = 0) -> float:
        def generate(tokens):
            prompts = [DECODE_PROMPT] * bsz
            return timed(lambda: generator.generate(prompts, tokens, temperature, top_p=0.9), "cpu", 1)

        return bsz * n / (generate(n + 1) - generate(1))

    def prefill(n: int) -> float:
        prompt = torch.randint(0, 128000, (1, n))
        return n / timed(lambda: generator.model.forward(prompt, 0, last_logits_only=True), "cpu", 1)

    def decode_after_long_prompt() -> float:
        # The model's steps themselves, timed apart from the prompt: a long prompt's time varies by more than
        # the steps take.
        model, token = generator.model, torch.tensor([[DECODE_PROMPT[-1]]])
        model.forward(torch.randint(0, 128000, (1, LONG_PROMPT)), 0, last_logits_only=True)
        seconds = timed(lambda: [model.forward(token, LONG_PROMPT + i) for i in range(steps)], "cpu", 1)
        return steps / seconds

    return {"decode b1": decode(1, steps), "decode b8": decode(8, steps // 2),
            "decode b1 sampled": decode(1, steps, temperature=0.6), "prefill 64": prefill(64),
            "prefill 512": prefill(512), f"decode b1 after {LONG_PROMPT}": decode_after_long_prompt()}  # fmt: skip


def fused_switch(generator: Llama):
    """On: `FusedQKV` and `FusedW13` run their layers as one product; off: each layer alone, on its own copy."""
    if not any(isinstance(m, llama.runtime.cpu.FusedProduct) for m in generator.model.modules()):
        sys.exit("No fused products here: they need float16 copies (fbgemm, x86) or oneDNN bfloat16 kernels")
    runs_on_a_copy = llama.runtime.cpu.layers.runs_on_a_copy

    def switch(on: bool) -> None:
        llama.runtime.cpu.layers.runs_on_a_copy = runs_on_a_copy if on else lambda kernel, dtype: False

    return switch


def require_fp16_copies(layers) -> None:
    if not any("fp16" in layer.kernels.values() for layer in layers):
        sys.exit("No float16 copies here: they need fbgemm (x86), memory for them, and to measure fastest "
                 "(or LLAMA_CPU_KERNEL=fp16)")  # fmt: skip


def measured_kernels_switch(generator: Llama, against: str):
    """On: the kernels measured at load (`llama.runtime.cpu.choose_kernels`); off: every product on `against`."""
    layers = [m for m in generator.model.modules() if isinstance(m, CPULinear)]
    measured = {layer: layer.kernels for layer in layers}
    pinned = {}
    for layer in layers:
        fp16_holds = llama.runtime.cpu.holds_bfloat16_values(layer.weight)
        pinned[layer] = {
            rows: against
            if against in llama.runtime.cpu.candidate_kernels(layer.weight.dtype, rows, fp16_holds, True)
            else "linear"
            for rows in layer.kernels
        }

    def switch(on: bool) -> None:
        for layer in layers:
            layer.kernels = measured[layer] if on else pinned[layer]

    return switch


def matmul_attention_switch(generator: Llama):
    attentions = [block.attention for block in generator.model.layers]
    kernel = attentions[0].one_position_attention
    if kernel is None:
        sys.exit("One position's bfloat16 attention was measured faster on SDPA at every length here")

    def switch(on: bool) -> None:
        for attention in attentions:
            attention.one_position_attention = kernel if on else None

    return switch


def fp16_call_switch(generator: Llama):
    require_fp16_copies([m for m in generator.model.modules() if isinstance(m, CPULinear)])
    fp16_products = llama.runtime.cpu.fp16_products

    def plain_call(rows, packed):
        return [torch.ops.quantized.linear_dynamic_fp16(rows, block) for block in packed]

    def switch(on: bool) -> None:
        llama.runtime.cpu.kernels.fp16_products = fp16_products if on else plain_call

    return switch


def top_p_head_switch(generator: Llama):
    sizes = llama.decoding.sampling.NUCLEUS_HEAD_SIZES

    def switch(on: bool) -> None:
        llama.decoding.sampling.NUCLEUS_HEAD_SIZES = sizes if on else ()

    return switch


def greedy_numpy_switch(generator: Llama):
    def switch(on: bool) -> None:
        llama.decoding.sampling.greedy_pick = greedy_pick if on else functools.partial(torch.argmax, dim=-1)

    return switch


SPEEDUPS = {"fused": ("bfloat16", fused_switch), "measured-kernels": ("bfloat16", measured_kernels_switch),
            "matmul-attention": ("bfloat16", matmul_attention_switch), "top-p-head": ("bfloat16", top_p_head_switch),
            "greedy-numpy": ("bfloat16", greedy_numpy_switch), "fp16-call": ("bfloat16", fp16_call_switch)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("speedup", choices=sorted(SPEEDUPS))
    parser.add_argument("--shapes", nargs="+", default=["d256", "d1024"])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=16, help="batch-1 decode steps per run (batch 8: half)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the speed-up's own")
    parser.add_argument(
        "--against", choices=llama.runtime.cpu.KERNELS, default="linear", help="measured-kernels: off is this"
    )
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    args = parser.parse_args()
    dtype, make_switch = SPEEDUPS[args.speedup]
    dtype = args.dtype or dtype
    if args.speedup == "measured-kernels":
        make_switch = functools.partial(make_switch, against=args.against)
    for shape in args.shapes:
        checkpoint = meta_checkpoint(shape, args.workdir, default_tokenizer(), "cpu")
        generator = Llama.build(str(checkpoint), max_seq_len=1024, max_batch_size=8, device="cpu", dtype=dtype)
        generator.tokenizer.stop_tokens = set()  # random weights: decode for exactly the steps asked
        switch = make_switch(generator)
        runs = {True: [], False: []}
        for pair in range(args.pairs + 1):  # the first pair warms up (and makes any copies)
            for on in (True, False) if pair % 2 else (False, True):
                switch(on)
                figures = measure(generator, args.steps)
                if pair:
                    runs[on].append(figures)
        switch(True)  # as it was: the next shape's switch starts from the library's own setting
        print(f"{shape} {dtype}, {args.pairs} pairs: {args.speedup} on / off, median (range)")
        for figure in runs[True][0]:
            ratios = [on[figure] / off[figure] for on, off in zip(runs[True], runs[False])]
            on, off = (statistics.median(r[figure] for r in runs[way]) for way in (True, False))
            print(f"  {figure}: {on:.1f} / {off:.1f} tok/s, "
                  f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}x to {max(ratios):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
