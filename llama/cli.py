"""What the command-line entry points share: flags checked before anything runs, and a user's mistake reported as
one line that names the flag to change, not as a traceback.

A user's mistake is what the library raises as `ValueError`, `FileNotFoundError` or `FileExistsError` (a missing
folder, a device that is not here, a value out of range). Any other exception is a bug, and keeps its traceback.
"""

import inspect
import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional

import fire

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)


def run(main: Callable, argv: Optional[List[str]] = None) -> None:
    """Run `main` as a fire command line, after checking that every flag in `argv` (default: sys.argv) is one of
    its parameters: fire itself reports a mistyped flag only once `main` has run to the end."""
    argv = sys.argv[1:] if argv is None else argv
    parameters = inspect.signature(main).parameters
    unknown = unknown_flags(argv, parameters)
    if unknown:
        valid = ", ".join(f"--{name}" for name in parameters)
        fail(f"unknown flag{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the flags are: {valid}")
    with user_errors(parameters):
        fire.Fire(main, command=argv)


def unknown_flags(argv: List[str], parameters: Iterable[str]) -> List[str]:
    """The `--flags` of `argv` that name none of `parameters` (fire also takes `--name-with-dashes`, `--noflag`
    for a false boolean, and `--help`; what follows a lone `--` is fire's own)."""
    names = set(parameters) | {"help"}
    unknown = []
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name not in names and not (name.startswith("no") and name[2:] in names):
            unknown.append(arg.split("=", 1)[0])
    return unknown


@contextmanager
def user_errors(flags: Iterable[str]) -> Iterator[None]:
    """Turn a user's mistake raised inside into `error: <message>` on stderr and exit status 2, with each of
    `flags` that the message names written as the flag (`--max_batch_size`)."""
    try:
        yield
    except USER_ERRORS as e:
        message = str(e)
        for flag in flags:
            # the flag's name as a word of its own, not inside a path such as /data/ckpt_dir/params.json
            message = re.sub(rf"(?<![\w/.-]){re.escape(flag)}(?![\w/-])(?!\.\w)", f"--{flag}", message)
        fail(message)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
