"""One process of a model-parallel run, launched by tests/test_parallel.py under torchrun (or plain python).

    torchrun --nproc_per_node M tests/parallel_worker.py CKPT_DIR TOKENIZER OUT_PREFIX [--fail raise --fail-rank 1]
        [--compile] [--quantize int8|int4] [--greedy-only] [--dtype bfloat16] [--also CKPT_DIR:int8 ...]

Every rank builds the Llama, completes PROMPTS greedily and then (unless --greedy-only) two of them with sampling
and all of them in a next turn, and writes OUT_PREFIX.rank{R}.json: its token IDs, a sha256 per parameter of the
weights it loaded and the CPU kernels it runs. Rank 0 also prints the greedy generations. Each `--also` item then
builds another checkpoint in the same processes, quantized as it says, and writes OUT_PREFIX.also{I}.rank{R}.json
(one launch serves several checkpoints: starting the processes is most of a run's time). `--fail` makes one rank
misbehave on purpose, to test that the others stop; it writes OUT_PREFIX.rank{R}.failed_at (a time.time()) first.
Every rank writes OUT_PREFIX.rank{R}.pid.
"""

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta

from llama import Llama

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Tides rise and fall twice a day because",
    "Count in Spanish: one => uno, two => dos, three =>",
]
HANG_SECONDS = 600  # longer than any test waits: a rank that never comes back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir")
    parser.add_argument("tokenizer_path")
    parser.add_argument("out_prefix")
    parser.add_argument("--max-gen-len", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=60, help="Llama.build's process-group timeout, seconds")
    parser.add_argument("--fail", choices=["raise", "hang"], help="make --fail-rank raise or hang after build")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-ckpt-dir", help="--fail-rank builds from this (broken) checkpoint instead")
    parser.add_argument("--compile", action="store_true", help="decode through the compiled decode step")
    parser.add_argument("--quantize", choices=["int8", "int4"], help="Llama.build's quantize")
    parser.add_argument("--greedy-only", action="store_true", help="complete greedily only (no sampling, no next turn)")
    parser.add_argument("--dtype", default="float32", help="Llama.build's dtype")
    parser.add_argument("--also", nargs="+", default=[], help="CKPT_DIR:SCHEME items, built and run in turn")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    failing = rank == args.fail_rank
    with open(f"{args.out_prefix}.rank{rank}.pid", "w") as f:  # lets the test end a worker it left behind
        f.write(str(os.getpid()))

    ckpt_dir = args.fail_ckpt_dir if failing and args.fail_ckpt_dir else args.ckpt_dir
    run(args, ckpt_dir, args.quantize, args.out_prefix, rank, failing)
    for index, item in enumerate(args.also):
        also_dir, _, scheme = item.rpartition(":")
        run(args, also_dir, scheme, f"{args.out_prefix}.also{index}", rank, False)


def run(args, ckpt_dir: str, quantize, out_prefix: str, rank: int, failing: bool) -> None:
    """Build `ckpt_dir` quantized as `quantize`, complete PROMPTS, write OUT_PREFIX.rank{R}.json."""
    generator = Llama.build(
        ckpt_dir,
        args.tokenizer_path,
        max_seq_len=64,
        max_batch_size=len(PROMPTS),
        device="cpu",
        dtype=args.dtype,  # float32 by default: what Meta folders get on CPU anyway
        timeout=timedelta(seconds=args.timeout),
        compile=args.compile,
        quantize=quantize,
        prefix_cache=True,  # the next turn below reuses the first's cache
    )
    if rank == 0:  # the library prints nothing; its report of the load is the caller's to show
        print(generator.load_report)
    if failing and args.fail:
        with open(f"{out_prefix}.rank{rank}.failed_at", "w") as f:  # when the others lose this rank
            f.write(str(time.time()))
        if args.fail == "raise":
            raise RuntimeError(f"rank {rank} fails on purpose after build")
        time.sleep(HANG_SECONDS)  # hang: never enter the collectives the other ranks wait in

    prompt_tokens = [generator.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]  # as text_completion
    greedy, _ = generator.generate(prompt_tokens, args.max_gen_len, temperature=0)
    sampled = next_turn = None
    if not args.greedy_only:
        # Fewer, shorter samples: on a CPU, sorting the 128256 probabilities each step costs more than the model.
        sampled, _ = generator.generate(prompt_tokens[:2], args.max_gen_len // 2, temperature=0.6, top_p=0.9)
        # A next turn (each prompt, its greedy answer and a few more tokens), from what the cache holds, then cold.
        turn = [p + g + p[1:4] for p, g in zip(prompt_tokens, greedy)]
        warm, _ = generator.generate(turn, 4, temperature=0)
        reused = generator.decoder.last_reused
        generator.model.cached.forget()
        cold, _ = generator.generate(turn, 4, temperature=0)
        next_turn = {"warm": warm, "cold": cold, "reused": reused}
    for prompt, tokens in zip(PROMPTS, greedy):
        if rank == 0:  # every rank has the same tokens; the library leaves printing to its caller
            print(f"{prompt!r} -> {generator.tokenizer.decode(tokens)!r}")
    weights = {
        key: hashlib.sha256(tensor.float().contiguous().numpy().tobytes()).hexdigest()
        for key, tensor in generator.model.state_dict().items()
    }
    attention = generator.model.layers[0].attention.one_position_attention  # None: SDPA at every cache length
    result = {
        "rank": rank,
        "greedy": greedy,
        "sampled": sampled,
        "next_turn": next_turn,
        "weights": weights,
        "kernels": generator.model.kernels_in_use,
        "matmul_attention_from": attention.keywords["from_positions"] if attention is not None else None,
    }
    if args.compile:  # how many graphs the compiled decode step became, and the reasons it was broken up
        from torch._dynamo.utils import counters  # imported only here: torch._dynamo takes seconds to import

        result["compiled_graphs"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = list(counters["graph_break"])
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
