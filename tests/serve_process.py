"""A `llama serve` process for the tests (tests/test_serve.py): on a free loopback port, its output in a
file, waited for until /health answers."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import free_port, with_repo

PORT_ATTEMPTS = 3  # servers started before a test gives up on finding a free port


class Server:
    """A `llama serve` process (`python -m llama serve`) on loopback, its output in a file."""

    def __init__(self, ckpt: Path, log: Path, *flags: str, launcher=(sys.executable, "-m")):
        self.log = log
        for attempt in range(PORT_ATTEMPTS):
            # The port is free when chosen, but another process (a client's own end of a connection) may take it
            # before the server binds it: then the server exits saying so, and starts again on another.
            self.start(ckpt, free_port(), flags, launcher)
            if self.wait_until_healthy():
                return
            if "address already in use" not in log.read_text() or attempt == PORT_ATTEMPTS - 1:
                pytest.fail(f"the server did not start:\n{log.read_text()}")

    def start(self, ckpt: Path, port: int, flags, launcher) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        command = [*launcher, "llama", "serve", str(ckpt), "--port", str(port), *flags]  # `llama serve`
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=with_repo(root))
        with open(self.log, "w") as out:
            # SIGINT as a shell's foreground program gets it, even where pytest runs with it ignored (a background job)
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env, preexec_fn=default_sigint
            )

    def wait_until_healthy(self) -> bool:
        """Whether /health answered before the process ended or 120 s passed (then the process is stopped)."""
        deadline = time.time() + 120
        while not self.healthy():
            if self.process.poll() is not None or time.time() > deadline:
                self.stop()
                return False
            time.sleep(0.2)
        return True

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
