"""What the chat reads from a person: lines with editing and history where the terminal has readline, messages of
several lines, and dialogs saved as JSON.

History lives in `$XDG_STATE_HOME/llama3/chat_history` (by default `~/.local/state/llama3/chat_history`), so that
the up arrow recalls what was typed in earlier sessions too.
"""

import json
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

from llama.tokenizer import ROLES, Message

HISTORY_LENGTH = 1000  # lines kept in the history file
BLOCK = '"""'  # a line of its own that opens, and another that closes, a message of several lines
CONTINUED = "\\"  # a line ending in it goes on on the next line
CONTINUATION_PROMPT = "... "
MAX_DIALOG_BYTES = 16 * 2**20  # a dialog file larger than this is refused before it is read


def history_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "llama3" / "chat_history"


class LineEditor:
    """`input` with readline's line editing and a history file, where stdin and stdout are a terminal and Python
    has readline; plain `input` otherwise (a pipe, a file, Windows without readline)."""

    def __init__(self, commands: Sequence[str] = ()):
        self.readline = None
        self.commands = list(commands)
        if sys.stdin.isatty() and sys.stdout.isatty():
            try:
                import readline  # importing it is what gives `input` line editing
            except ImportError:
                return
            self.readline = readline
            self.path = history_file()
            readline.set_history_length(HISTORY_LENGTH)
            readline.set_completer(self.complete)  # Tab completes a /command
            readline.set_completer_delims(" \t\n")
            libedit = "libedit" in (readline.__doc__ or "")  # macOS's Python: another syntax for key bindings
            readline.parse_and_bind("bind ^I rl_complete" if libedit else "tab: complete")
            try:
                readline.read_history_file(self.path)
            except OSError:  # none yet, or unreadable: start a new one
                pass

    def __call__(self, prompt: str) -> str:
        line = input(prompt)
        if self.readline is not None and line.strip():
            self.save()
        return line

    def complete(self, text: str, state: int) -> Optional[str]:
        """readline's completer: the `state`-th command that starts with `text`, at the start of the line."""
        at_start = self.readline.get_line_buffer().lstrip().startswith(text)
        matches = [c for c in self.commands if c.startswith(text)] if text.startswith("/") and at_start else []
        return matches[state] if state < len(matches) else None

    def save(self) -> None:
        """Write the history now, so that a session that ends by Ctrl-C or a crash keeps it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.path)
        except OSError:
            pass  # a read-only home: the history lasts this session only


def read_message(prompt: str, input_fn: Callable[[str], str]) -> str:
    """One message, which may span lines: between a line `\"\"\"` and the next, or continued by a trailing `\\`.
    EOFError when input ends before the message does."""
    line = input_fn(prompt)
    if line.strip().startswith(BLOCK):
        first = line.strip()[len(BLOCK) :]
        if first.endswith(BLOCK):  # """all on one line"""
            return first[: -len(BLOCK)].strip()
        lines = [first]
        while True:
            line = input_fn(CONTINUATION_PROMPT).rstrip()
            if line.endswith(BLOCK):
                lines.append(line[: -len(BLOCK)])
                return "\n".join(lines).strip()
            lines.append(line)
    lines = [line]
    while lines[-1].endswith(CONTINUED):
        lines[-1] = lines[-1][: -len(CONTINUED)]
        lines.append(input_fn(CONTINUATION_PROMPT))
    return "\n".join(lines).strip()


def save_dialog(path: str, dialog: List[Message]) -> None:
    """Write `dialog` as a JSON list of {"role", "content"} messages (what `load_dialog` reads back); its images
    must be paths already (`llama.cli.chat_images.saved_dialog`)."""
    text = json.dumps(dialog, indent=2, ensure_ascii=False) + "\n"
    try:
        Path(path).expanduser().write_text(text, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None


def load_dialog(path: str) -> List[Message]:
    """The dialog saved in `path`, checked: a JSON list of messages with a known role and content of text (or text
    and image parts, each image by its path), a system message only first. A ValueError says what is wrong with
    the file."""
    file = Path(path).expanduser()
    try:
        if file.stat().st_size > MAX_DIALOG_BYTES:
            raise ValueError(f"{path} is larger than {MAX_DIALOG_BYTES // 2**20} MiB; is it a saved dialog?")
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a JSON file ({e}); /save writes the files /load reads") from None
    return checked_dialog(data, path)


def checked_dialog(data, path: str) -> List[Message]:
    if not isinstance(data, list):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not a list of messages")
    dialog = []
    for i, message in enumerate(data):
        content = saved_content(message.get("content")) if isinstance(message, dict) else None
        if content is None:
            raise ValueError(
                f'message {i} of {path} is not {{"role": ..., "content": "text"}} (or a list of {{"type": "text", '
                f'"text": ...}} and {{"type": "image", "image": "a path"}} parts)'
            )
        role = message.get("role")
        if role not in ROLES["3.1"]:  # every role a message may have; the model's version is checked as it is sent
            roles = ", ".join(ROLES["3.1"])
            raise ValueError(f"message {i} of {path} has role {str(role)[:40]!r}; the roles are {roles}")
        if role == "system" and i > 0:
            raise ValueError(f"message {i} of {path} is a system message; only the first message may be one")
        dialog.append({"role": role, "content": content})
    return dialog


def saved_content(content) -> Union[str, List[dict], None]:
    """A message's content as /save writes it: a text, or a list of text parts and image parts that hold an image
    file's path (the images are read by `llama.cli.chat_images.opened_dialog`); None for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image") or not isinstance(part.get(kind), str):
            return None
        parts.append({"type": kind, kind: part[kind]})
    return parts


def closest_command(word: str, commands: List[str]) -> Optional[str]:
    """The command `word` most likely meant (a typo such as /exti), or None when none is close."""
    import difflib

    by_lowercase = {command.lower(): command for command in commands}
    matches = difflib.get_close_matches(word.lower(), by_lowercase, n=1, cutoff=0.5)
    return by_lowercase[matches[0]] if matches else None
