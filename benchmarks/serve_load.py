"""Load on `python -m llama.serve`: N chat requests sent at once (half streamed, half not) with the `openai` client,
against the same requests sent one at a time; prints throughput, time to first token and latency percentiles.

    python -m llama.demo /tmp/demo                       # the demo checkpoint
    python benchmarks/serve_load.py --ckpt_dir /tmp/demo --concurrency 8 --runs 3
    python benchmarks/serve_load.py --url http://127.0.0.1:8000/v1 --model demo   # a server already running

With --ckpt_dir it starts a server of its own on a free loopback port (--max_batch_size = --concurrency) and stops
it at the end. Each run sends the sequential pass and the concurrent pass of the same requests, back to back, so
that both meet the same machine load; the summary gives each figure's median and range over the runs.
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

import httpx
import openai

QUESTIONS = [
    "Tell me about the sea.", "What is a prime number?", "Write a haiku about autumn.", "Why is the sky blue?",
    "Name three rivers.", "How do bees make honey?", "Explain recursion.", "What is the speed of light?",
]  # fmt: skip


def start_server(args) -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.url = f"http://127.0.0.1:{port}/v1"
    args.model = "bench"
    command = [sys.executable, "-m", "llama.serve", "--ckpt_dir", args.ckpt_dir, "--port", str(port),
               "--max_batch_size", str(args.concurrency), "--max_seq_len", str(args.max_seq_len),
               "--model_name", "bench"]  # fmt: skip
    log = open(Path(tempfile.gettempdir()) / f"serve_load_{port}.log", "w")
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                               env=dict(os.environ, PYTHONPATH=str(root)))  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        try:
            if httpx.get(args.url.removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not start; see {log.name}")


def one_request(client: openai.OpenAI, args, i: int) -> Dict[str, float]:
    """Send request i (streamed when i is odd); its latency, time to first token (streamed only) and tokens."""
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    common = dict(model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=args.temperature)
    start = time.perf_counter()
    if i % 2 == 0:
        answer = client.chat.completions.create(**common)
        return {"latency": time.perf_counter() - start, "tokens": answer.usage.completion_tokens}
    first, tokens = None, 0
    for chunk in client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens}


def sequential(client, args) -> Dict[str, float]:
    start = time.perf_counter()
    results = [one_request(client, args, i) for i in range(args.concurrency)]
    return summary(results, time.perf_counter() - start)


def concurrent(client, args) -> Dict[str, float]:
    results: List[dict] = [{}] * args.concurrency

    def send(i):
        results[i] = one_request(client, args, i)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(args.concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summary(results, time.perf_counter() - start)


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(results: List[dict], wall: float) -> Dict[str, float]:
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall, "p50_s": percentile(latencies, 0.5),
            "p90_s": percentile(latencies, 0.9), "max_s": max(latencies),
            "ttft_p50_s": percentile(ttfts, 0.5) if ttfts else float("nan")}  # fmt: skip


def show(name: str, figures: Dict[str, float]) -> None:
    print(f"  {name:10} " + "  ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_dir", help="start a server on this checkpoint")
    parser.add_argument("--url", help="or use the server at this base URL (…/v1)")
    parser.add_argument("--model", default="bench", help="the model name, with --url")
    parser.add_argument("--api_key", default="none")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once (and the server's rows)")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if bool(args.ckpt_dir) == bool(args.url):
        parser.error("give --ckpt_dir or --url")
    server = start_server(args) if args.ckpt_dir else None
    try:
        client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
        one_request(client, args, 0)  # warm-up
        speedups, ttft_ratio = [], []
        for run in range(1, args.runs + 1):
            print(f"run {run}: {args.concurrency} requests of up to {args.max_tokens} tokens", flush=True)
            alone, together = sequential(client, args), concurrent(client, args)
            show("sequential", alone)
            show("concurrent", together)
            speedups.append(together["tok_per_s"] / alone["tok_per_s"])
            ttft_ratio.append(together["ttft_p50_s"] / alone["ttft_p50_s"])
        print(f"throughput, concurrent / sequential: median {statistics.median(speedups):.2f}x "
              f"(range {min(speedups):.2f}-{max(speedups):.2f}x over {args.runs} runs)")  # fmt: skip
        print(f"median time to first token, concurrent / sequential: median {statistics.median(ttft_ratio):.2f}x")
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
