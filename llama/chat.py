"""An interactive terminal chat with streamed answers, on top of `Llama.chat_completion_stream`.

Commands: `/help` lists them, `/reset` clears the history (keeping the system prompt), `/exit` (or end of input)
quits. Ctrl-C stops the current answer and keeps the session. Under torchrun, rank 0 reads the input and
broadcasts it, and every rank generates in step; there Ctrl-C reaches every process (and torchrun, which then
stops them all), so it ends the chat at once.
"""

import signal
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator, List, Optional, TextIO

import torch.distributed as dist

from llama.generation import Llama
from llama.tokenizer import Message

# Waiting for a person to type is not a fault: the input broadcast gets its own, patient process group.
INPUT_TIMEOUT = timedelta(days=7)

COMMANDS = {
    "/help": "list these commands",
    "/reset": "clear the history (the system prompt stays)",
    "/exit": "quit (so does end of input, Ctrl-D)",
}
ENDED_BY_CTRL_C = "[Ctrl-C under torchrun: torchrun stops every process, so the chat ends here]"


def several_processes() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def ctrl_c_interrupts() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt inside, however the process was started: a shell that runs it in the
    background, or under `trap "" INT`, starts Python with SIGINT ignored."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """A multi-turn dialog that keeps its history within the model's max_seq_len."""

    def __init__(
        self,
        generator: Llama,
        system_prompt: Optional[str] = None,
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        out: Optional[TextIO] = None,
    ):
        self.generator = generator
        self.system_prompt = system_prompt
        self.temperature, self.top_p, self.max_gen_len = temperature, top_p, max_gen_len
        self.out = out or sys.stdout  # looked up now: ranks > 0 have a silenced stdout
        self.history: List[Message] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def answer_room(self) -> int:
        """Tokens kept free for the answer: max_gen_len, or a quarter of the context."""
        max_seq_len = self.generator.model.params.max_seq_len
        return min(self.max_gen_len or max_seq_len // 4, max_seq_len - 1)

    def trim_history(self) -> None:
        """Drop the oldest turns (never the system prompt or the newest message) until the answer fits."""
        limit = self.generator.model.params.max_seq_len - self.answer_room()
        first = 1 if self.system_prompt else 0
        dropped = 0
        while len(self.generator.formatter.encode_dialog_prompt(self.history)) > limit:
            if len(self.history) - first <= 1:
                self.history.pop()
                raise ValueError(
                    f"This message alone does not fit in max_seq_len={self.generator.model.params.max_seq_len} "
                    f"with {self.answer_room()} tokens left for the answer; send a shorter one"
                )
            del self.history[first]
            dropped += 1
        if dropped:
            print(f"[history too long: dropped the {dropped} oldest message(s)]", file=self.out, flush=True)

    def send(self, text: str) -> str:
        """Add a user message, stream the answer to `out`, and return it (partial if interrupted)."""
        self.history.append({"role": "user", "content": text})
        self.trim_history()
        pieces, n_tokens, start = [], 0, time.time()
        print("Assistant: ", end="", file=self.out, flush=True)
        try:
            for chunk in self.generator.chat_completion_stream(
                [self.history], self.temperature, self.top_p, self.max_gen_len
            ):
                pieces.append(chunk.text)
                n_tokens = chunk.n_tokens
                print(chunk.text, end="", file=self.out, flush=True)
        except KeyboardInterrupt:
            if several_processes():
                print(f"\n{ENDED_BY_CTRL_C}", file=self.out, flush=True)
                raise SystemExit(130) from None
            print("\n[stopped]", end="", file=self.out)
        elapsed = time.time() - start
        answer = "".join(pieces)
        self.history.append({"role": "assistant", "content": answer})
        print(f"\n[{n_tokens} tokens in {elapsed:.1f} s, {n_tokens / max(elapsed, 1e-9):.1f} tokens/s]", file=self.out)
        return answer


def read_line(prompt: str, input_fn: Callable[[str], str], group) -> str:
    """Rank 0 reads a line (EOF means /exit, Ctrl-C an empty line); every rank gets it."""
    line = [None]
    if dist.get_rank() == 0:
        try:
            line[0] = input_fn(prompt).strip()
        except EOFError:
            line[0] = "/exit"
        except KeyboardInterrupt:
            print()
            line[0] = ""
            if several_processes():  # the others are waiting for this line: tell them to end too
                print(ENDED_BY_CTRL_C)
                line[0] = "/exit"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(line, src=0, group=group)
    return line[0]


def run_chat(
    generator: Llama,
    system_prompt: Optional[str] = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_gen_len: Optional[int] = None,
    input_fn: Callable[[str], str] = input,
    out: Optional[TextIO] = None,
) -> None:
    """Run the interactive chat until /exit or end of input."""
    out = out or sys.stdout
    group = dist.new_group(backend="gloo", timeout=INPUT_TIMEOUT) if dist.get_world_size() > 1 else None
    session = ChatSession(generator, system_prompt, temperature, top_p, max_gen_len, out)
    print("Chat with the model. Commands: /help lists them, /reset clears the history, /exit quits.", file=out)
    with ctrl_c_interrupts():
        while True:
            line = read_line("User: ", input_fn, group)
            if line == "/exit":
                break
            if line == "/help":
                print("\n".join(f"  {name:8} {what}" for name, what in COMMANDS.items()), file=out)
                print("  Ctrl-C   stop the answer being written", file=out)
            elif line == "/reset":
                session.reset()
                print("[history cleared]", file=out)
            elif line:
                try:
                    session.send(line)
                except ValueError as e:
                    print(f"[{e}]", file=out)
