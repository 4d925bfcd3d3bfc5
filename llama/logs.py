"""How the library and its command lines speak: through `logging`, to stderr, never on stdout.

The library only logs. A command line (the `llama` command, the example scripts) calls `show_logs` once: by default
a person sees warnings and the `llama.progress` notices (what was loaded, that a step is compiling), and with
`--verbose` everything at INFO and above.
"""

import contextlib
import io
import logging
import sys
from typing import Iterator

PROGRESS_LOGGER = "llama.progress"


def show_logs(verbose: bool = False) -> None:
    """Send log records to stderr as plain lines: warnings and progress notices, or with `verbose` all INFO ones.
    A handler the program already set up on the root logger is kept, and only the levels change."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)


@contextlib.contextmanager
def stdout_to_log(logger: logging.Logger, level: int = logging.INFO) -> Iterator[None]:
    """Lines that code inside writes to stdout (a dependency that prints, such as fairscale) become log records of
    `logger` at `level` instead."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        for line in captured.getvalue().splitlines():
            if line.strip():
                logger.log(level, "%s", line.strip())
