"""Shared test fixtures. Plain helpers (the tokenizer lookup, checkpoints, reference math) are in helpers.py."""

from datetime import timedelta
from pathlib import Path

import pytest
from helpers import find_tokenizer_path, make_checkpoint


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    """The Llama 3 tokenizer.model path (see `helpers.find_tokenizer_path`)."""
    return find_tokenizer_path()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A one-shard tiny checkpoint (`helpers.TINY_PARAMS`, seed 0), shared by the tests that only read it."""
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
