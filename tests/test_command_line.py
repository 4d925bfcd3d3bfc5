"""The command lines: a mistyped flag or a bad value stops the script before anything loads, and a user's mistake
is one line naming the flag to change, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama.cli import common

ROOT = Path(__file__).resolve().parent.parent


def run(*args, timeout=120):
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def example_main(ckpt_dir: str, max_seq_len: int = 128, compile: bool = False):
    raise AssertionError("never reached with a bad flag")


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["--ckpt_dir", "x", "--max_sequence_len", "64"], ["--max_sequence_len"]),
        (["x", "--max_seq_len=64", "--max-seq-len", "9", "--compile", "--nocompile"], []),
        (["x", "--help"], []),
        (["x", "--", "--trace"], []),  # fire's own flags, after a lone --
        (["--ckpt", "x", "--seed=3"], ["--ckpt", "--seed"]),
    ],
)
def test_unknown_flags_are_found_before_running(argv, unknown):
    assert common.unknown_flags(argv, ["ckpt_dir", "max_seq_len", "compile"]) == unknown


def test_a_mistyped_flag_stops_with_the_valid_flags(capsys):
    with pytest.raises(SystemExit) as stopped:
        common.run(example_main, ["--ckpt_dir", "x", "--max_sequence_len", "64"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: unknown flag --max_sequence_len; the flags are: --ckpt_dir, --max_seq_len, --compile\n"
    )


def test_a_user_error_is_one_line_naming_the_flag(capsys):
    def main(ckpt_dir: str, max_batch_size: int = 4):
        raise ValueError(f"5 prompts exceed max_batch_size={max_batch_size}; raise max_batch_size (in {ckpt_dir}/x)")

    with pytest.raises(SystemExit) as stopped:
        common.run(main, ["/data/max_batch_size", "--max_batch_size", "4"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: 5 prompts exceed --max_batch_size=4; raise --max_batch_size (in /data/max_batch_size/x)\n"
    )


def test_what_every_process_computes_is_shown_by_the_first_only(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # one process, no torchrun: it shows everything
    assert common.rank0_stream(sys.stdout) is sys.stdout
    monkeypatch.setenv("RANK", "0")
    assert common.rank0_stream(sys.stderr) is sys.stderr
    monkeypatch.setenv("RANK", "1")
    elsewhere = common.rank0_stream(sys.stdout)
    assert elsewhere is not sys.stdout and elsewhere.name == os.devnull
    print("dropped", file=elsewhere, flush=True)


def test_a_programming_error_keeps_its_traceback():
    def main(ckpt_dir: str):
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        common.run(main, ["x"])


@pytest.mark.slow
def test_example_stops_on_a_mistyped_flag_before_loading(tiny_checkpoint, tokenizer_path):
    result = run(
        "example_text_completion.py",
        "--ckpt_dir",
        tiny_checkpoint,
        "--tokenizer_path",
        tokenizer_path,
        "--max_sequence_len",
        "64",
    )
    assert result.returncode == 2
    assert result.stdout == ""  # nothing loaded, no completion printed
    assert result.stderr.startswith("error: unknown flag --max_sequence_len; the flags are: --ckpt_dir, ")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "error: --temperature must be a finite number >= 0 (0 means greedy), got -1\n"),
        (["--top_p", "0"], "error: --top_p must be a number in (0, 1], got 0\n"),
        (["--max_gen_len", "-1"], "error: --max_gen_len must be a non-negative integer or None, got -1\n"),
    ],
)
def test_sampling_flags_are_checked_before_the_checkpoint(flags, message):
    result = run("example_text_completion.py", "--ckpt_dir", "no/such/folder", *flags)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message)


@pytest.mark.slow
def test_example_user_errors_are_one_line(tiny_checkpoint, tokenizer_path):
    missing = run("example_chat_completion.py", "--ckpt_dir", "no/such/folder")
    assert (missing.returncode, missing.stderr) == (2, "error: Checkpoint directory no/such/folder does not exist\n")
    flags = ["--ckpt_dir", tiny_checkpoint, "--tokenizer_path", tokenizer_path, "--max_batch_size", "2"]
    too_small = run("example_text_completion.py", *flags)
    assert too_small.returncode == 2
    assert too_small.stderr == "error: 4 prompts exceed --max_batch_size=2; raise --max_batch_size\n"
    bad_device = run("example_text_completion.py", "--ckpt_dir", tiny_checkpoint, "--device", "tpu")
    assert bad_device.returncode == 2
    assert bad_device.stderr == "error: Unknown --device 'tpu'; use 'cpu', 'cuda', 'cuda:N' or 'mps'\n"


@pytest.mark.slow
def test_help_shows_each_flag_type():
    result = run("example_chat_completion.py", "--help")
    shown = result.stdout + result.stderr  # fire pages the help, or writes it to stderr without a terminal
    assert result.returncode == 0
    assert "Optional[Optional]" not in shown
    assert "Type: Optional[str]" in shown and "131072" in shown


@pytest.mark.slow
def test_demo_names_its_own_flag(tmp_path):
    result = run("-m", "llama.demo", tmp_path / "demo", "--shards", "3")
    assert result.returncode == 2
    assert "Change --shards to one of them" in result.stderr
    assert "Traceback" not in result.stderr and "nproc_per_node" not in result.stderr
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_demo_can_be_written_twice_but_never_over_other_files(tmp_path):
    demo = tmp_path / "demo"
    first = run("-m", "llama.demo", demo)
    assert first.returncode == 0, first.stderr
    weights = (demo / "consolidated.00.pth").read_bytes()
    again = run("-m", "llama.demo", demo)
    assert again.returncode == 0, again.stderr
    assert (demo / "consolidated.00.pth").read_bytes() == weights  # the same seed writes the same weights
    (demo / "notes.txt").write_text("mine")
    refused = run("-m", "llama.demo", demo)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: ") and "notes.txt" in refused.stderr
    assert (demo / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_convert_user_errors_are_one_line(tmp_path):
    result = run("-m", "llama.convert", "to-hf", tmp_path / "missing", tmp_path / "out")
    missing = tmp_path / "missing"
    assert (result.returncode, result.stderr) == (2, f"error: Checkpoint directory {missing} does not exist\n")


@pytest.mark.slow
def test_convert_quantize_names_the_flag_at_fault(tiny_checkpoint, tmp_path):
    result = run(
        "-m", "llama.convert", "quantize", tiny_checkpoint, tmp_path / "q", "--scheme", "int4", "--group_size", "100"
    )
    assert (result.returncode, result.stderr) == (2, "error: --group_size must be one of (256, 128, 64, 32), got 100\n")
    result = run("-m", "llama.convert", "quantize", tiny_checkpoint, tmp_path / "q", "--scheme", "int4")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "q" / "params.json").read_text())["quantization"] == {
        "scheme": "int4",
        "group_size": 32,
    }
