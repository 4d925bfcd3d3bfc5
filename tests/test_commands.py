"""The `llama` command as a new user meets it, run as a real process (`python -m llama`, which is what the installed
`llama` script runs): its help and version, each subcommand's flags, mistakes reported before anything loads, the
text it streams, and the chat on pipes and on a pseudo-terminal (line editing, history, Ctrl-C)."""

import ast
import inspect
import json
import os
import pty
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from helpers import on_a_terminal, read_until, wait_for_exit, with_repo

import llama
import llama.cli.main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_ONLY = {"ckpt_dir", "interactive", "cuda_graphs"}  # the example's; `llama` has CKPT_DIR, --nocuda_graphs


def env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=with_repo(ROOT), **extra)


def llama_command(*args, input=None, timeout=300, **extra_env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llama", *map(str, args)],
        cwd=ROOT,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**extra_env),
    )


def example(script, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env()
    )


def example_flags(script: str) -> set:
    main = runpy.run_path(str(ROOT / script))["main"]
    return set(inspect.signature(main).parameters)


def shown_flags(help_text: str) -> set:
    return set(re.findall(r"--(\w+)", help_text))


@pytest.fixture(scope="module")
def unloadable_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint's params.json beside a weight file that cannot load: a run that reaches the weights fails
    naming that file, so a run that fails otherwise checked its flags before loading."""
    folder = tmp_path_factory.mktemp("unloadable")
    (folder / "params.json").write_text((tiny_checkpoint / "params.json").read_text())
    (folder / "consolidated.00.pth").write_bytes(b"not a checkpoint")
    return folder


# Help, version and routing -----------------------------------------------------------------------------------------


def test_version_is_the_package_version_and_the_installed_one(monkeypatch):
    monkeypatch.chdir(ROOT)  # setup.py reads requirements.txt from the folder it runs in
    result = llama_command("--version")
    assert (result.returncode, result.stdout) == (0, f"llama {llama.__version__}\n")
    with mock.patch("setuptools.setup") as setup:  # what `pip install` would record as the version
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    assert setup.call_args.kwargs["version"] == llama.__version__


def test_version_and_help_answer_before_torch_loads():
    """The command line's own modules (and the sampling defaults its flags show) import no torch: `--version` and
    `-h` answer in a fraction of a second, as llama/__init__.py promises."""
    code = "import sys, llama.cli.main; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_console_script_is_declared_and_runs_the_same_main(monkeypatch):
    monkeypatch.chdir(ROOT)
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    scripts = setup.call_args.kwargs["entry_points"]["console_scripts"]
    assert scripts == ["llama = llama.cli.main:main"]
    module, function = scripts[0].split(" = ")[1].split(":")
    main = getattr(__import__(module, fromlist=[function]), function)
    assert main is llama.cli.main.main
    assert runpy.run_path(str(ROOT / "llama" / "__main__.py"))["main"] is main  # python -m llama


def test_only_the_documented_modules_run_as_programs():
    """`python -m llama`, `llama.serve`, `llama.demo` and `llama.convert` are the package's programs; every other
    module is a library module, which a `__main__` block would import a second time (and import back in a circle)."""
    programs = set()
    for path in (ROOT / "llama").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                programs.add(path.relative_to(ROOT).as_posix())
    assert programs == {"llama/__main__.py", "llama/serve/__main__.py", "llama/demo.py", "llama/convert.py"}
    for module in ("llama.serve", "llama.demo", "llama.convert"):
        shown = subprocess.run(
            [sys.executable, "-m", module, "-h"], cwd=ROOT, capture_output=True, text=True, env=env()
        )
        assert shown.returncode == 0 and shown.stdout.startswith("usage: "), shown.stderr


def test_help_lists_every_command():
    result = llama_command("-h")
    assert result.returncode == 0 and result.stdout.startswith("usage: llama ")
    for command in ("chat", "complete", "serve", "convert", "demo"):
        assert re.search(rf"^\s+{command}\s+\w", result.stdout, re.MULTILINE), command


@pytest.mark.parametrize(
    "command, script", [("chat", "example_chat_completion.py"), ("complete", "example_text_completion.py")]
)
def test_chat_and_complete_take_the_examples_flags(command, script):
    result = llama_command(command, "-h")
    assert result.returncode == 0 and result.stdout.startswith(f"usage: llama {command} ")
    flags = shown_flags(result.stdout)
    assert example_flags(script) - EXAMPLE_ONLY <= flags
    assert {"seed", "verbose", "nocuda_graphs"} <= flags


def test_serve_convert_and_demo_are_their_own_command_lines():
    for command in ("convert", "demo"):
        result = llama_command(command, "-h")
        assert result.returncode == 0 and result.stdout.startswith(f"usage: llama {command} "), result.stderr
    serve = llama_command("serve", "-h")
    assert serve.returncode == 0 and serve.stdout.startswith("usage: llama serve "), serve.stderr
    assert "--max_batch_size" in serve.stdout and "--api_key" in serve.stdout
    twice = llama_command("serve", "ckpt", "--ckpt_dir", "ckpt")
    assert twice.returncode == 2 and "give the checkpoint folder once" in twice.stderr


# Mistakes, reported before anything loads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["no/such/folder", "Hi"], "error: Checkpoint directory no/such/folder does not exist\n"),
        (["x", "Hi", "--top_p", "2"], "error: --top_p must be a number in (0, 1], got 2.0\n"),
    ],
)
def test_a_mistake_is_one_line_naming_the_flag(args, message):
    result = llama_command("complete", *args)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message)


@pytest.mark.parametrize(
    "command, flag, value, message",
    [
        (
            "complete",
            "--temperature",
            "-1",
            "error: --temperature must be a finite number >= 0 (0 means greedy), got -1.0\n",
        ),
        ("complete", "--top_p", "0", "error: --top_p must be a number in (0, 1], got 0.0\n"),
        ("complete", "--max_gen_len", "-1", "error: --max_gen_len must be a non-negative integer or None, got -1\n"),
        ("chat", "--top_p", "1.5", "error: --top_p must be a number in (0, 1], got 1.5\n"),
    ],
)
def test_a_sampling_flag_s_mistake_is_reported_before_torch_loads(tiny_checkpoint, command, flag, value, message):
    """Seconds sooner: the flags given are checked before the checkpoint's defaults are read (which imports torch).
    The console script's `main`, then whether torch was imported on stdout."""
    code = "\n".join(
        ["import sys", "from llama.cli.main import main", "try:", "    main(sys.argv[1:])", "finally:"]
        + ["    print('torch' in sys.modules)"]
    )
    argv = [command, tiny_checkpoint, *(["Hi"] if command == "complete" else []), flag, value]
    result = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, env=env())
    assert (result.returncode, result.stdout, result.stderr) == (2, "False\n", message)


def test_a_bad_choice_or_a_mistyped_flag_is_refused_with_usage():
    result = llama_command("chat", "x", "--quantize", "int9")
    assert result.returncode == 2
    assert "argument --quantize: invalid choice: 'int9'" in result.stderr and "Traceback" not in result.stderr
    result = llama_command("chat", "x", "--max_sequence_len", "64")
    assert result.returncode == 2 and result.stderr.startswith("usage: llama chat ")  # the command's usage
    assert result.stderr.endswith(
        "llama chat: error: unrecognized arguments: --max_sequence_len 64 (did you mean --max_seq_len?)\n"
    )


def test_flags_may_be_spelt_with_dashes():
    result = llama_command("complete", "no/such/folder", "Hi", "--max-seq-len", "64", "--top-p=2")
    assert (result.returncode, result.stderr) == (2, "error: --top_p must be a number in (0, 1], got 2.0\n")
    for command in ("chat", "complete"):  # every flag shown is one the dashes and the error messages know
        shown = shown_flags(llama_command(command, "-h").stdout) - {"help"}
        assert shown <= set(llama.cli.main.FLAGS), shown - set(llama.cli.main.FLAGS)


def test_a_prompt_too_long_is_refused_before_the_weights_load(unloadable_checkpoint, tokenizer_path):
    flags = ["--tokenizer_path", tokenizer_path, "--max_seq_len", "4"]
    result = llama_command("complete", unloadable_checkpoint, "one two three four five", *flags)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "error: The prompt is 6 tokens long, longer than --max_seq_len=4; raise --max_seq_len\n"


def test_an_empty_prompt_on_stdin_is_refused(unloadable_checkpoint):
    result = llama_command("complete", unloadable_checkpoint, input="")
    assert (result.returncode, result.stderr) == (2, "error: The prompt is empty; give it as an argument or on stdin\n")


# Generating ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_complete_streams_only_the_new_text_to_stdout(tiny_checkpoint, tokenizer_path, tiny_llama):
    prompt = "The capital of France is"
    expected = tiny_llama.text_completion([prompt], temperature=0, max_gen_len=8)[0]["generation"]
    flags = ["--tokenizer_path", tokenizer_path, "--max_seq_len", "64", "--temperature", "0", "--max_gen_len", "8"]
    flags += ["--device", "cpu"]  # where `tiny_llama` runs, on any machine
    for result in (
        llama_command("complete", tiny_checkpoint, prompt, *flags),
        llama_command("complete", tiny_checkpoint, *flags, input=prompt + "\n"),  # on stdin, as `echo` writes it
        llama_command("complete", tiny_checkpoint, "-", *flags, input=prompt),
    ):
        assert result.returncode == 0, result.stderr
        assert result.stdout == expected + "\n"
        # A busy machine may add its notice that the kernels' timings were noisy, before the load's line.
        lines = [line for line in result.stderr.splitlines() if not line.startswith("The CPU was busy")]
        assert re.fullmatch(
            r"Loaded in \d+\.\d\d seconds: Meta checkpoint, device cpu, dtype float32, not quantized, "
            r"model-parallel size 1",
            lines[0],
        ), result.stderr
        assert re.fullmatch(r"\[8 tokens in \d+\.\d s, \d+\.\d tokens/s\]", lines[-1]), result.stderr
        assert "initializing" not in result.stdout + result.stderr  # fairscale's lines, unless --verbose


@pytest.mark.slow
def test_chat_on_pipes(tiny_checkpoint, tokenizer_path, tmp_path):
    saved, broken = tmp_path / "dialog.json", tmp_path / "broken.json"
    broken.write_text('[{"role": "user", "content": 3}]')
    script = "\n".join(
        [
            "/exti",
            "/foo bar",
            "/system Answer briefly.",
            '"""',
            "first line",
            "second line",
            '"""',
            "ab \\",
            "cd",
            f"/save {saved}",
            f"/load {broken}",
            "/exit",
            "never read",
        ]
    )
    flags = ["--tokenizer_path", tokenizer_path, "--max_seq_len", "128", "--max_gen_len", "4"]
    result = llama_command("chat", tiny_checkpoint, *flags, input=script + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "[unknown command /exti. Did you mean /exit? The commands: /help, /reset, /system, /save" in out
    assert "[unknown command /foo. The commands: " in out
    assert out.count("Assistant: ") == 2  # the two messages; no command reached the model
    speeds = re.findall(r"\[4 tokens in [\d.]+ s, [\d.]+ tokens/s(?:, (\d+) prompt tokens reused)?\]", out)
    assert speeds[0] == "" and int(speeds[1]) > 20  # the second message reused the first turn's cached dialog
    dialog = json.loads(saved.read_text())
    assert [m["role"] for m in dialog] == ["system", "user", "assistant", "user", "assistant"]
    assert dialog[0]["content"] == "Answer briefly."
    assert dialog[1]["content"] == "first line\nsecond line" and dialog[3]["content"] == "ab \ncd"
    assert f"[message 0 of {broken} is not " in out and "Traceback" not in result.stderr
    assert result.stderr.startswith("Loaded in ")


# On a terminal ---------------------------------------------------------------------------------------------------


def terminal(args, **extra_env):
    """`python -m llama ARGS` on a pseudo-terminal (stdin, stdout and stderr); yields (pid, the terminal's fd)."""
    return on_a_terminal([sys.executable, *map(str, args)], env(**extra_env), cwd=ROOT)


UP_ARROW = b"\x1b[A"
LONG_ANSWER = ["--max_seq_len", "2048", "--max_gen_len", "2000"]  # still being written when Ctrl-C comes


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
def test_the_up_arrow_recalls_earlier_messages_across_sessions_and_tab_completes(
    tiny_checkpoint, tokenizer_path, tmp_path
):
    state = tmp_path / "state"
    flags = ["--tokenizer_path", tokenizer_path, "--max_seq_len", "128", "--max_gen_len", "3"]
    chat = ["-m", "llama", "chat", tiny_checkpoint, *flags]
    with terminal(chat, XDG_STATE_HOME=str(state)) as (pid, fd):
        read_until(fd, rb"User: ", 120)
        os.write(fd, b"What is a lighthouse?\r")
        read_until(fd, rb"tokens/s\]\r?\nUser: ", 60)
        os.write(fd, b"/exit\r")
        assert wait_for_exit(pid, fd, 30)[0] == 0
    assert "What is a lighthouse?" in (state / "llama3" / "chat_history").read_text()

    saved = tmp_path / "dialog.json"
    with terminal(chat, XDG_STATE_HOME=str(state)) as (pid, fd):
        read_until(fd, rb"User: ", 120)
        os.write(fd, UP_ARROW + UP_ARROW)  # the last line typed was /exit, the one before it the question
        read_until(fd, rb"What is a lighthouse\?", 10)  # redrawn on the line, not sent as ^[[A
        os.write(fd, b"\r")
        read_until(fd, rb"tokens/s\]\r?\nUser: ", 60)
        os.write(fd, f"/save {saved}\r".encode())
        read_until(fd, rb"\[saved 2 messages", 10)
        os.write(fd, b"/ex\t\r")  # Tab completes the command
        code, output = wait_for_exit(pid, fd, 30)
    assert code == 0
    assert b"^[[A" not in output
    assert json.loads(saved.read_text())[0] == {"role": "user", "content": "What is a lighthouse?"}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("when", ["at the prompt", "while loading"])
def test_ctrl_c_ends_the_chat_with_one_line_and_status_130(tiny_checkpoint, tokenizer_path, tmp_path, when):
    chat = ["-m", "llama", "chat", tiny_checkpoint, "--tokenizer_path", tokenizer_path, "--max_seq_len", "128"]
    if when == "while loading":
        chat.append("--verbose")  # the log says when the checkpoint starts to load
    with terminal(chat, XDG_STATE_HOME=str(tmp_path)) as (pid, fd):
        if when == "at the prompt":
            read_until(fd, rb"User: ", 120)
            # as a person would, a moment after the prompt shows: a signal in the instant before readline waits for
            # a key is only seen at the next key (CPython's readline checks for signals when its wait is cut short)
            time.sleep(0.5)
        else:
            read_until(fd, rb"Loading a Meta checkpoint", 120)
        os.write(fd, b"\x03")  # Ctrl-C as typed: the terminal sends SIGINT
        code, output = wait_for_exit(pid, fd, 30)
    assert code == 130
    after = output.decode(errors="replace").replace("^C", "").strip()
    if when == "at the prompt":
        assert after.splitlines() == ["Interrupted (Ctrl-C)"], output
    else:  # after the log lines of the load so far
        assert after.splitlines()[-1:] == ["Interrupted (Ctrl-C)"] and "Traceback" not in after, output
        assert "User: " not in after  # ended while loading, not at the prompt


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
def test_ctrl_c_ends_an_example_with_one_line_and_status_130(tiny_checkpoint, tokenizer_path):
    command = ["example_text_completion.py", "--ckpt_dir", tiny_checkpoint, "--tokenizer_path", tokenizer_path]
    command += LONG_ANSWER
    with terminal(command) as (pid, fd):
        read_until(fd, rb"Loaded in ", 120)
        time.sleep(1)  # into the generation
        os.write(fd, b"\x03")
        code, output = wait_for_exit(pid, fd, 30)
    assert code == 130
    tail = output.decode(errors="replace").replace("^C", "").strip()
    assert tail.splitlines()[-1:] == ["Interrupted (Ctrl-C)"] and "Traceback" not in tail, output


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
def test_ctrl_c_under_torchrun_is_one_line_from_the_processes(tmp_path, tokenizer_path):
    """Ctrl-C reaches torchrun and both ranks: the ranks end with one line between them and status 130, no
    traceback each (`[rank0]: Traceback ...`). torchrun then reports the stop in its own words."""
    from helpers import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "mp2", n_shards=2, seed=4)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*torchrun, "example_text_completion.py", "--ckpt_dir", checkpoint, "--tokenizer_path", tokenizer_path]
    command += [*LONG_ANSWER, "--device", "cpu"]  # two ranks: the CPU holds both on any machine
    with terminal(command) as (pid, fd):
        read_until(fd, rb"Loaded in ", 120)
        time.sleep(1)  # into the generation
        os.write(fd, b"\x03")
        output = wait_for_exit(pid, fd, 60)[1].decode(errors="replace")
    assert output.count("Interrupted (Ctrl-C)") == 1, output
    assert "[rank" not in output and "KeyboardInterrupt" not in output, output


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
def test_ctrl_c_ends_a_completion_with_its_text_then_one_line(tiny_checkpoint, tokenizer_path):
    command = ["-m", "llama", "complete", tiny_checkpoint, "Once upon a time", "--tokenizer_path", tokenizer_path]
    command += LONG_ANSWER
    with terminal(command) as (pid, fd):
        read_until(fd, rb"model-parallel size 1", 120)  # loaded: writing next
        time.sleep(1)
        os.write(fd, b"\x03")
        code, output = wait_for_exit(pid, fd, 30)
    assert code == 130
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    assert lines[-1] == "Interrupted (Ctrl-C)" and "Traceback" not in output.decode(errors="replace"), output
