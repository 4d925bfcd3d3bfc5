"""Shared test fixtures. Plain helpers (the tokenizer lookup, checkpoints, reference math) are in helpers.py."""

import os
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import find_tokenizer_path, make_checkpoint
from hypothesis import settings

# Property-based tests: a bounded, repeatable run by default; HYPOTHESIS_PROFILE=long searches far wider (random
# seeds, many more examples) for a fuzzing session.
settings.register_profile("default", max_examples=60, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=5000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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
