"""The interactive chat: a scripted terminal session, history trimming and Ctrl-C."""

import io
import os
import pty
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import on_a_terminal, read_until, wait_for_exit

from llama import Llama
from llama.cli.chat import ChatSession, run_chat
from llama.runtime.cached_tokens import common_prefix_length
from llama.tokenizer import ChatFormat, Tokenizer

REPO = Path(__file__).resolve().parents[1]


def chat_command(checkpoint, tokenizer_path, *extra):
    return [
        sys.executable,
        str(REPO / "example_chat_completion.py"),
        "--ckpt_dir",
        str(checkpoint),
        "--tokenizer_path",
        tokenizer_path,
        "--interactive",
        *extra,
    ]


@pytest.mark.slow
def test_scripted_session_through_stdin(tiny_checkpoint, tokenizer_path):
    script = "Hello there\n/reset\n\nWhat is the capital of France?\n/exit\nnever read\n"
    result = subprocess.run(
        chat_command(tiny_checkpoint, tokenizer_path, "--max_gen_len", "6", "--system_prompt", "Be brief"),
        input=script,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("Assistant: ") == 2  # two questions answered; the empty line asked nothing
    assert "[history cleared]" in out
    speeds = re.findall(r"\[6 tokens in [\d.]+ s, [\d.]+ tokens/s(?:, (\d+) prompt tokens reused)?\]", out)
    assert len(speeds) == 2
    # After /reset, the second question reused the cache up to where it differs from the first: the system prompt
    # and the user header (the first answer had nothing cached).
    formatter = ChatFormat(Tokenizer(tokenizer_path))
    system = {"role": "system", "content": "Be brief"}
    first, second = (
        formatter.encode_dialog_prompt([system, {"role": "user", "content": text}])
        for text in ("Hello there", "What is the capital of France?")
    )
    assert speeds == ["", str(common_prefix_length(first, second))]
    assert out.rstrip().endswith("User:")  # /exit ended the session before the last line was read


def test_end_of_input_ends_the_session(tiny_llama):
    lines = iter(["hi"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    run_chat(tiny_llama, max_gen_len=4, input_fn=read, out=out)  # returns instead of waiting for more
    assert out.getvalue().count("Assistant: ") == 1


def test_each_turn_runs_only_what_changed_after_system_and_load(tiny_llama):
    """The chat's next turn reuses the cache up to where its prompt first differs from what the cache holds: the
    whole dialog after a plain turn, the start before the system prompt's text after /system, the shared start
    after /load. (`llama chat` builds with prefix_cache=True; here a second `Llama` on the same model does.)"""
    tiny_llama = Llama(tiny_llama.model, tiny_llama.tokenizer, prefix_cache=True)
    out = io.StringIO()
    session = ChatSession(tiny_llama, system_prompt="Be brief.", temperature=0, max_gen_len=4, out=out)
    tiny_llama.model.cached.forget()

    def send(text: str) -> int:
        """Send `text`; how many of the prompt's tokens the cache held, and what it should have held."""
        held = list(tiny_llama.model.cached[0])
        session.send(text)
        prompt = tiny_llama.formatter.encode_dialog_prompt(session.history[:-1])
        assert tiny_llama.decoder.last_reused == [min(common_prefix_length(held, prompt), len(prompt) - 1)]
        return tiny_llama.decoder.last_reused[0]

    assert send("Hello") == 0
    first = tiny_llama.formatter.encode_dialog_prompt(session.history[:2])
    assert send("Tell me more") >= len(first)  # the first turn's whole prompt, and its answer
    session.set_system_prompt("Be verbose.")
    header = len(tiny_llama.formatter.encode_dialog_prompt([{"role": "system", "content": ""}])) - 5
    assert header <= send("Again") < len(first)  # up to the system prompt's text
    session.load([{"role": "user", "content": "Hello"}])
    assert 0 < send("Once more") < header + 5  # <|begin_of_text|> and the header's start only


def test_history_is_trimmed_oldest_first_with_a_notice(tiny_llama):
    out = io.StringIO()
    session = ChatSession(tiny_llama, system_prompt="You are terse.", temperature=0, max_gen_len=8, out=out)
    questions = [f"Question number {n}: tell me something about topic {n}." for n in range(4)]
    for question in questions:
        session.send(question)
        prompt = tiny_llama.formatter.encode_dialog_prompt(session.history[:-1])
        assert len(prompt) + 8 <= tiny_llama.model.params.max_seq_len  # the answer had room
    assert "dropped the" in out.getvalue()
    assert session.history[0] == {"role": "system", "content": "You are terse."}
    kept = [m["content"] for m in session.history if m["role"] == "user"]
    assert kept[-1] == questions[-1] and questions[0] not in kept
    assert kept == questions[len(questions) - len(kept) :]  # what remains is the most recent turns, in order


def test_a_message_too_long_for_the_context_is_refused_not_fatal(tiny_llama):
    out = io.StringIO()
    lines = iter(["word " * 200, "short", "/exit"])
    run_chat(tiny_llama, temperature=0, max_gen_len=4, input_fn=lambda prompt: next(lines), out=out)
    text = out.getvalue()
    assert "does not fit in max_seq_len=64" in text
    assert text.count("Assistant: ") == 1  # the long one was refused before generating; "short" was answered


class InterruptingGenerator:
    """Wraps a Llama so that its stream raises KeyboardInterrupt after two chunks, like Ctrl-C would."""

    def __init__(self, llama):
        self.llama = llama
        self.model, self.formatter, self.decoder = llama.model, llama.formatter, llama.decoder

    def chat_completion_stream(self, *args, **kwargs):
        for n, chunk in enumerate(self.llama.chat_completion_stream(*args, **kwargs)):
            if n == 2:
                raise KeyboardInterrupt
            yield chunk


def test_ctrl_c_stops_the_answer_and_keeps_the_session(tiny_llama):
    out = io.StringIO()
    session = ChatSession(InterruptingGenerator(tiny_llama), temperature=0, max_gen_len=20, out=out)
    partial = session.send("Tell me a long story")
    assert "[stopped]" in out.getvalue()
    assert session.history[-1] == {"role": "assistant", "content": partial}
    session.generator = tiny_llama
    session.send("And another one")
    assert len(session.history) == 4


def test_help_lists_the_commands_without_asking_the_model(tiny_llama):
    out = io.StringIO()
    lines = iter(["/help", "/exit"])
    run_chat(tiny_llama, max_gen_len=4, input_fn=lambda prompt: next(lines), out=out)
    text = out.getvalue()
    assert "Assistant: " not in text
    for command in ("/help", "/reset", "/exit", "Ctrl-C"):
        assert f"\n  {command} " in text


def test_a_message_without_content_names_the_message(tiny_llama):
    with pytest.raises(ValueError, match=r"must be a dict with a 'role' and a 'content'; got \{'role': 'user'\}"):
        tiny_llama.chat_completion([[{"role": "user"}]], max_gen_len=2)


def test_ctrl_c_with_several_processes_ends_the_chat_at_once(tiny_llama, monkeypatch):
    """Under torchrun, Ctrl-C also reaches torchrun, which stops every process: the chat must not offer a prompt
    that is about to be killed. An answer interrupted ends the process; Ctrl-C at the prompt tells the others to
    end too (rank 0 broadcasts it)."""
    import llama.cli.chat

    monkeypatch.setattr(llama.cli.chat, "several_processes", lambda: True)
    out = io.StringIO()
    session = ChatSession(InterruptingGenerator(tiny_llama), temperature=0, max_gen_len=20, out=out)
    with pytest.raises(SystemExit) as ended:
        session.send("Tell me a long story")
    assert ended.value.code == 130
    assert out.getvalue().endswith("[Ctrl-C under torchrun: torchrun stops every process, so the chat ends here]\n")

    def interrupted(prompt):
        raise KeyboardInterrupt

    monkeypatch.setattr(llama.cli.chat.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(llama.cli.chat.dist, "get_world_size", lambda group=None: 1)  # nothing to broadcast to here
    with pytest.raises(SystemExit) as ended:  # at the prompt: every rank ends, rank 0 saying so
        llama.cli.chat.read_line("User: ", interrupted, group=None)
    assert ended.value.code == 130


def in_a_terminal(command, sigint):
    """Run `command` on a pseudo-terminal, started with SIGINT set to `sigint`; yields (pid, the terminal's fd)."""
    return on_a_terminal(command, dict(os.environ, OMP_NUM_THREADS="1"), sigint=sigint)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
def test_ctrl_c_in_a_real_terminal(tiny_checkpoint, tokenizer_path):
    # A long answer budget, so that Ctrl-C arrives mid-answer. Started with SIGINT ignored, as from `trap "" INT`
    # or a background job: the chat must set its own handler. Set explicitly, so that how the test suite itself
    # was started cannot matter.
    command = chat_command(tiny_checkpoint, tokenizer_path, "--max_seq_len", "2048", "--max_gen_len", "2000")
    with in_a_terminal(command, signal.SIG_IGN) as (pid, fd):
        read_until(fd, rb"User: ", 120)
        os.write(fd, b"Tell me everything\n")
        read_until(fd, rb"Assistant: \S+", 60)
        os.kill(pid, signal.SIGINT)
        read_until(fd, rb"\[stopped\][^\n]*\n\[\d+ tokens in .*\n.*User: ", 60)
        os.write(fd, b"/exit\n")
        assert wait_for_exit(pid, fd, 30)[0] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_interactive_chat_under_torchrun_with_model_parallelism(tmp_path, tokenizer_path):
    """Rank 0 reads stdin and broadcasts; both ranks generate in step: the answers equal one process's."""
    from helpers import make_checkpoint

    one, two = make_checkpoint(tmp_path / "mp1", seed=4), make_checkpoint(tmp_path / "mp2", n_shards=2, seed=4)
    script = "Hello there\n/reset\nWhat now?\n/exit\n"
    options = ("--max_gen_len", "6", "--temperature", "0", "--device", "cpu")  # two ranks: two GPUs or the CPU
    env = dict(os.environ, OMP_NUM_THREADS="1")
    alone = subprocess.run(
        chat_command(one, tokenizer_path, *options), input=script, capture_output=True, text=True, timeout=180, env=env
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    together = subprocess.run(
        torchrun + chat_command(two, tokenizer_path, *options)[1:],
        input=script,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert alone.returncode == 0 and together.returncode == 0, together.stderr[-2000:]

    def answers(out):
        return re.findall(r"Assistant: (.*)\n\[6 tokens", out)

    assert len(answers(alone.stdout)) == 2
    assert answers(together.stdout) == answers(alone.stdout)
    assert together.stdout.count("[history cleared]") == 1  # printed by rank 0 only


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not hasattr(pty, "fork"), reason="needs a pseudo-terminal")
def test_ctrl_c_under_torchrun_ends_the_chat_at_once(tmp_path, tokenizer_path):
    """Ctrl-C in the terminal reaches torchrun and both ranks: one line says the chat ends, and it ends within
    seconds, without a new prompt and without torchrun having to kill a rank that ignored its signal."""
    from helpers import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "mp2", n_shards=2, seed=4)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    flags = ("--max_seq_len", "2048", "--max_gen_len", "2000", "--device", "cpu")  # two ranks: the CPU holds both
    command = torchrun + chat_command(checkpoint, tokenizer_path, *flags)[1:]
    with in_a_terminal(command, signal.SIG_DFL) as (pid, fd):
        read_until(fd, rb"User: ", 120)
        os.write(fd, b"Tell me everything\n")
        read_until(fd, rb"Assistant: [^\n]*\S", 60)
        os.write(fd, b"\x03")  # Ctrl-C, as typed: SIGINT to the terminal's foreground processes
        after = read_until(fd, rb"the chat ends here\]", 15)
        after += wait_for_exit(pid, fd, 15)[1]
        tail = after.split(b"^C", 1)[-1]
        assert b"User: " not in tail  # no prompt that would be killed
        assert b"forcefully exiting" not in tail
