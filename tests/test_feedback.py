"""What the library and its command lines tell a person: a progress bar only on a terminal, compiling announced and
kept out of the speed, and the small messages a new user met (each once wrong, here as it should read)."""

import io
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import llama.checkpoint.report
from llama.checkpoint import check_kv_cache_fits
from llama.checkpoint.report import weights_bar
from llama.cli import common, demo
from llama.cli.main import build_parser
from llama.decoding.speculative import DraftCounts
from llama.decoding.speed import Stopwatch
from llama.model import ModelArgs
from llama.quantize import SCHEMES, check_scheme
from llama.runtime.compiled import AnnouncedCompiles

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def slowly(n):
    for i in range(n):
        time.sleep(0.02)
        yield i


def test_the_load_bar_shows_only_on_a_terminal_and_only_from_rank_0(monkeypatch):
    monkeypatch.setattr(llama.checkpoint.report, "BAR_DELAY", 0)
    for stderr, rank, drawn in [(Terminal(), 0, True), (io.StringIO(), 0, False), (Terminal(), 1, False)]:
        monkeypatch.setattr(sys, "stderr", stderr)
        assert list(weights_bar(slowly(5), 5, rank)) == list(range(5))  # the items pass through unchanged
        assert ("Loading weights" in stderr.getvalue() and "5/5" in stderr.getvalue()) == drawn


def test_a_quick_load_draws_no_bar(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert list(weights_bar(range(3), 3, 0)) == [0, 1, 2]
    assert sys.stderr.getvalue() == ""  # done within BAR_DELAY


def test_compiling_is_announced_once_per_batch_size_and_left_out_of_the_speed(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="llama.progress")
    clock = [0.0]  # perf_counter's seconds, moved only by the steps: no wall clock, so a busy machine changes nothing
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    compiled = set()

    def step(tokens, position):  # compiles (30 s) the first time it sees a batch size; a compiled step takes 0.25 s
        clock[0] += 0.25 if tokens.shape[0] in compiled else 30.0
        compiled.add(tokens.shape[0])
        return tokens

    stub = {"decode_step": AnnouncedCompiles(step), "last_reused": [], "last_drafts": DraftCounts()}
    decoder = type("Decoder", (), stub)()
    stopwatch = Stopwatch(decoder)
    for bsz in (1, 1, 4, 1):
        decoder.decode_step(torch.zeros(bsz, 1), torch.tensor([0]))
    notices = [r.getMessage() for r in caplog.records]
    assert [n.split(" (")[0] for n in notices if n.startswith("Compiling")] == [
        "Compiling the decode step for batch size 1",
        "Compiling the decode step for batch size 4",
    ]
    assert decoder.decode_step.compile_seconds == 60.0
    assert stopwatch.speed(10).seconds == 0.5  # the two compiled steps; the two compiles' 60 s are not counted


def test_ranks_on_one_machine_share_its_memory_for_their_kv_caches(monkeypatch):
    """A KV cache that fits in the memory the machine has available does not fit in the share of each of two ranks
    of one job there (torchrun's LOCAL_WORLD_SIZE)."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=512, max_batch_size=4)
    cache_bytes = 2 * 2 * 4 * 512 * 4 * 16 * 4  # keys and values, layers, rows, positions, kv heads, head dim, float32
    monkeypatch.setattr("llama.distributed.available_memory", lambda: 3 * cache_bytes // 2)
    check_kv_cache_fits(args, 1, torch.device("cpu"), torch.float32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="lower max_batch_size or max_seq_len"):
        check_kv_cache_fits(args, 1, torch.device("cpu"), torch.float32)


def test_the_kv_cache_message_names_each_setting_once(monkeypatch, capsys):
    monkeypatch.setattr("llama.checkpoint.load.free_memory", lambda device: 1024)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=512, max_batch_size=4)
    with pytest.raises(ValueError, match=r"lower max_batch_size or max_seq_len$"):
        check_kv_cache_fits(args, 1, torch.device("cpu"), torch.float32)
    # as a command line says it
    with pytest.raises(SystemExit), common.user_errors(["max_batch_size", "max_seq_len"]):
        check_kv_cache_fits(args, 1, torch.device("cpu"), torch.float32)
    message = capsys.readouterr().err
    assert message.endswith("; lower --max_batch_size or --max_seq_len\n")
    assert message.count("--max_batch_size") == 2 and message.count("--max_seq_len") == 2  # its value, and the fix


def test_the_quantize_error_offers_only_what_a_flag_can_take():
    with pytest.raises(ValueError) as error:
        check_scheme("int3")
    assert str(error.value) == "Unknown quantization scheme 'int3'; use one of int8, int4"
    with pytest.raises(ValueError, match="was removed; use int8 or int4"):  # a scheme of earlier releases
        check_scheme("int8-dyn")
    for scheme in SCHEMES:  # and the command takes each (it names them itself, without torch)
        assert build_parser().parse_args(["chat", "ckpt", "--quantize", scheme]).quantize == scheme


def test_the_demo_names_no_flag_it_lacks(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as stopped:
        demo.main([str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path} holds more than a demo checkpoint (notes.txt); name a new or empty folder\n"
    )


def example(script, *args):
    return subprocess.run(
        [sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def unloadable_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint's params.json beside a weight file that cannot load: an example that stops on anything
    else checked it before loading the weights."""
    folder = tmp_path_factory.mktemp("unloadable")
    (folder / "params.json").write_text((tiny_checkpoint / "params.json").read_text())
    (folder / "consolidated.00.pth").write_bytes(b"not a checkpoint")
    return folder


def test_system_prompt_without_interactive_is_refused():
    result = example("example_chat_completion.py", "--ckpt_dir", "no/such/folder", "--system_prompt", "Be brief")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "error: --system_prompt is for the terminal chat only; add --interactive, or leave it out\n"


def test_the_tool_example_takes_quantize():
    result = example("example_tool_use.py", "--ckpt_dir", "no/such/folder", "--quantize", "int8")
    assert (result.returncode, result.stderr) == (2, "error: Checkpoint directory no/such/folder does not exist\n")


@pytest.mark.parametrize(
    "script, flags, message",
    [
        ("example_text_completion.py", ["--max_batch_size", "2"],
         r"4 prompts exceed --max_batch_size=2; raise --max_batch_size"),
        ("example_text_completion.py", ["--max_seq_len", "8"],
         r"Prompt 0 is \d+ tokens long, longer than --max_seq_len=8; raise --max_seq_len"),
        ("example_chat_completion.py", ["--max_batch_size", "3"],
         r"4 dialogs exceed --max_batch_size=3; raise --max_batch_size"),
        ("example_chat_completion.py", ["--max_seq_len", "20"],
         r"Dialog 0 is \d+ tokens long, longer than --max_seq_len=20; raise --max_seq_len"),
        ("example_tool_use.py", ["--max_seq_len", "100"],
         r"The dialog is \d+ tokens long, longer than --max_seq_len=100; raise --max_seq_len"),
    ],
)  # fmt: skip
def test_example_prompts_that_cannot_fit_are_refused_before_the_weights_load(
    unloadable_checkpoint, tokenizer_path, script, flags, message
):
    result = example(script, "--ckpt_dir", unloadable_checkpoint, "--tokenizer_path", tokenizer_path, *flags)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert re.fullmatch(message, result.stderr[len("error: ") : -1]), result.stderr


@pytest.mark.slow
def test_the_text_example_prints_what_it_loaded_and_its_speed_on_stdout(tiny_checkpoint, tokenizer_path):
    result = example("example_text_completion.py", "--ckpt_dir", tiny_checkpoint, "--tokenizer_path", tokenizer_path,
                     "--max_gen_len", "5", "--temperature", "0", "--device", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Loaded in ") and ": Meta checkpoint, device cpu, dtype float32" in lines[0]
    assert re.fullmatch(r"\[\d+ tokens in \d+\.\d s, \d+\.\d tokens/s\]", lines[-1]), lines[-1]
    assert result.stdout.count("==================================") == 4  # Meta's layout otherwise
    assert "initializing" not in result.stdout + result.stderr
