"""A library call leaves the rest of the process alone: no patched torch.nn methods, no global backend flags
flipped, no replaced sys.stdout. Other threads and other code in the same process see no change."""

import io
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch
from helpers import with_repo
from torch import nn

import llama.checkpoint.load
import llama.distributed
import llama.runtime.steps
from llama import Llama
from llama.checkpoint import AllocateOnMeta
from llama.model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parents[1]


def quiet_env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=with_repo(ROOT))


def test_building_on_the_meta_device_leaves_other_threads_alone(process_group):
    inside, built_elsewhere = threading.Event(), threading.Event()
    layers = {}

    def other_thread():
        inside.wait(10)
        layers["other"] = nn.Linear(4, 4)  # made while the main thread is inside AllocateOnMeta
        built_elsewhere.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with AllocateOnMeta():
        inside.set()
        built_elsewhere.wait(10)
        model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=8, max_batch_size=1))
    thread.join()
    assert all(p.device.type == "meta" for p in model.parameters())  # fairscale's torch.Tensor(...) weights too
    assert layers["other"].weight.device.type == "cpu"
    assert torch.isfinite(layers["other"].weight).all()
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # and nothing lingers after the block


def test_decoding_never_flips_global_backend_flags(tiny_checkpoint, tokenizer_path, process_group, monkeypatch):
    generator = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=32, max_batch_size=2, device="cpu", dtype="bfloat16"
    )
    calls = []
    enabled = type(torch.backends.mkldnn).__dict__["enabled"]  # what `torch.backends.mkldnn.enabled = x` runs
    monkeypatch.setattr(enabled, "setter", calls.append)
    tokens, _ = generator.generate([[128000, 791, 1917]], max_gen_len=4, temperature=0)  # one-row bf16 steps
    assert len(tokens[0]) == 4
    assert calls == []


def test_no_process_prints_and_stdout_stays(tiny_checkpoint, tokenizer_path, process_group, monkeypatch):
    """The library says nothing on stdout, on any rank: what was loaded is `load_report`, for the caller to show."""
    stdout = sys.stdout
    for rank in (1, 0):  # as torchrun's global ranks; the model-parallel rank stays 0
        monkeypatch.setattr(llama.distributed, "global_rank", lambda rank=rank: rank)
        monkeypatch.setattr(llama.checkpoint.load, "global_rank", lambda rank=rank: rank)
        monkeypatch.setattr(llama.runtime.steps, "global_rank", lambda rank=rank: rank)  # its kernels' line
        captured = io.StringIO()
        monkeypatch.setattr(sys, "stdout", captured)
        generator = Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=16, max_batch_size=1, device="cpu")
        assert sys.stdout is captured  # not replaced by the library
        assert captured.getvalue() == ""
    monkeypatch.undo()
    assert sys.stdout is stdout
    report = str(generator.load_report)
    assert re.fullmatch(
        r"Loaded in \d+\.\d\d seconds: Meta checkpoint, device cpu, dtype float32, not quantized, "
        r"model-parallel size 1\nKernels, by rows per call: 1 row: .+",
        report,
    ), report


def test_fairscale_says_nothing_on_stdout_from_the_python_api(tiny_checkpoint, tokenizer_path):
    """fairscale prints "> initializing model parallel ..." when its groups are made: in a fresh process, where
    `Llama.build` makes them, nothing reaches stdout, and the lines are log records for whoever asks."""
    script = (
        "import logging, sys; from llama import Llama\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        f"Llama.build({str(tiny_checkpoint)!r}, {tokenizer_path!r}, max_seq_len=16, max_batch_size=1, device='cpu')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=quiet_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == ""
    assert "initializing model parallel with size 1" in result.stderr  # through logging, at INFO


def test_loading_and_decoding_do_not_import_the_compiler_or_blobfile(tiny_checkpoint, tokenizer_path):
    """torch._dynamo takes about 2 s to import: a load that does not compile (the default on the CPU) never needs it,
    and a command's start does not wait for it. Nor for blobfile (a quarter of a second), from local files."""
    script = (
        "import sys; from llama import Llama\n"
        f"g = Llama.build({str(tiny_checkpoint)!r}, {tokenizer_path!r}, max_seq_len=16, max_batch_size=1, "
        "device='cpu')\n"
        "g.text_completion(['Hello'], max_gen_len=2)\n"
        "print(sorted(name for name in sys.modules if name.startswith(('torch._dynamo', 'blobfile'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=quiet_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "[]\n"


def test_the_process_group_ends_before_the_process_does():
    """A command's process group is destroyed at exit: NCCL warns on stderr about a group left to the interpreter's
    teardown ("destroy_process_group() was not called"), which would be the last line a user sees after a
    completion on a GPU. Gloo's group ends the same way, so the CPU shows it."""
    code = """
import atexit
from datetime import timedelta
import torch
import torch.distributed as dist
atexit.register(lambda: print("at exit, initialized:", dist.is_initialized()))  # runs after handlers added later
from llama.distributed import init_model_parallel
init_model_parallel(torch.device("cpu"), 1, timedelta(seconds=60))
print("after init, initialized:", dist.is_initialized())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=quiet_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["after init, initialized: True", "at exit, initialized: False"]
