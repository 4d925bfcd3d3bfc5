"""What the chat reads: messages of several lines, commands that never reach the model, /system, and dialogs saved
and loaded as JSON (a bad file is a one-line notice, the session goes on)."""

import io
import json
import re

import pytest

from llama.cli.chat import ChatSession, run_chat
from llama.cli.chat_input import load_dialog, read_message


def reader(*lines):
    """An input function that gives `lines`, then end of input."""
    remaining = iter(lines)

    def read(prompt):
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None

    return read


@pytest.mark.parametrize(
    "lines, message",
    [
        (['"""', "first", "", "  indented", '"""', "next"], "first\n\n  indented"),
        (['"""first', 'last"""'], "first\nlast"),
        (['"""one line"""'], "one line"),
        (["first \\", "second\\", "third"], "first \nsecond\nthird"),
        (["plain"], "plain"),
    ],
)
def test_a_message_may_span_lines(lines, message):
    assert read_message("User: ", reader(*lines)) == message


def test_input_that_ends_inside_a_block_ends_the_chat():
    with pytest.raises(EOFError):
        read_message("User: ", reader('"""', "never closed"))


def chat(llama, *lines):
    out = io.StringIO()
    run_chat(llama, temperature=0, max_gen_len=3, input_fn=reader(*lines), out=out)
    return out.getvalue()


def test_unknown_commands_are_answered_with_the_list_not_sent(tiny_llama):
    out = chat(tiny_llama, "/exti", "/foo", "/HELP please", "/exit")
    assert "Assistant: " not in out
    commands = "/help, /reset, /system, /save, /load, /image, /exit"
    assert f"[unknown command /exti. Did you mean /exit? The commands: {commands}]" in out
    assert "[unknown command /foo. The commands: " in out
    assert "[unknown command /HELP. Did you mean /help?" in out


def test_a_double_slash_sends_a_message_that_starts_with_a_slash(tiny_llama, tmp_path):
    out = chat(tiny_llama, "//usr/bin holds programs", f"/save {tmp_path / 'd.json'}")
    assert out.count("Assistant: ") == 1
    assert json.loads((tmp_path / "d.json").read_text())[0]["content"] == "/usr/bin holds programs"


def test_system_sets_the_system_prompt_and_keeps_the_history(tiny_llama, tmp_path):
    saved = tmp_path / "dialog.json"
    lines = ["Hello", "/system Answer in French.", "Again", f"/save {saved}", "/system", "/reset"]
    out = chat(tiny_llama, *lines, f"/save {tmp_path / 'empty.json'}")
    assert "[system prompt set]" in out and "[system prompt removed]" in out
    dialog = json.loads(saved.read_text())
    assert dialog[0] == {"role": "system", "content": "Answer in French."}
    assert [m["role"] for m in dialog[1:]] == ["user", "assistant", "user", "assistant"]
    assert json.loads((tmp_path / "empty.json").read_text()) == []  # no system prompt left to keep


def test_a_saved_dialog_loads_back_and_the_chat_goes_on(tiny_llama, tmp_path):
    saved = tmp_path / "dialog.json"
    chat(tiny_llama, "/system Be brief.", "What is a tide?", f"/save {saved}")
    first = json.loads(saved.read_text())
    out = io.StringIO()
    session = ChatSession(tiny_llama, temperature=0, max_gen_len=3, out=out)
    lines = iter([f"/load {saved}", "And the moon?", "/exit"])
    run_chat(tiny_llama, temperature=0, max_gen_len=3, input_fn=lambda prompt: next(lines), out=out)
    assert f"[loaded 3 messages from {saved}]" in out.getvalue()
    assert load_dialog(saved) == first
    session.load(first)
    assert session.system_prompt == "Be brief." and session.history == first


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "is not a JSON file"),
        ('{"role": "user", "content": "hi"}', "holds a JSON dict, not a list of messages"),
        ('[{"role": "user"}]', 'message 0 of {path} is not {{"role": ..., "content": "text"}}'),
        ('[{"role": "wizard", "content": "hi"}]', "message 0 of {path} has role 'wizard'; the roles are system, user"),
        ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]', "only the first message may be"),
    ],
)
def test_a_bad_dialog_file_is_a_notice_not_a_traceback(tiny_llama, tmp_path, content, problem):
    path = tmp_path / "dialog.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="^.*" + re.escape(problem.format(path=path))):
        load_dialog(path)
    out = chat(tiny_llama, f"/load {path}", "/load", f"/load {tmp_path / 'missing.json'}", "/exit")
    assert problem.format(path=path) in out
    assert "[/load needs a file name: /load FILE]" in out
    assert f"[cannot read {tmp_path / 'missing.json'}: No such file or directory]" in out


def test_a_dialog_that_cannot_be_written_is_a_notice(tiny_llama, tmp_path):
    out = chat(tiny_llama, f"/save {tmp_path / 'no' / 'such' / 'folder.json'}", "/exit")
    assert "[cannot write " in out and "No such file or directory]" in out
