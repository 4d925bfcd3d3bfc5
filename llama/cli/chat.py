"""An interactive terminal chat with streamed answers, on top of `Llama.chat_completion_stream`.

Commands (`COMMANDS`; /help lists them) start with `/`; an unknown one is answered with the list, never sent to the
model. Input is read by `llama.cli.chat_input`: line editing and history, messages of several lines, saved dialogs.
On a Llama 3.2 Vision model a message may carry images, by /image or by naming the file (`llama.cli.chat_images`).
Ctrl-C stops the current answer and keeps the session; at the prompt it ends the chat. Under torchrun, rank 0
reads the input and broadcasts it, and every rank generates in step; there Ctrl-C reaches every process (and
torchrun, which then stops them all), so it ends the chat at once.
"""

import signal
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator, List, Optional, TextIO, TypeVar, Union

import torch.distributed as dist

from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.cli.chat_images import (
    ImagePart,
    described,
    image_count,
    images_named_in,
    open_attachment,
    opened_dialog,
    saved_dialog,
    takes_images,
    unquoted,
    user_content,
)
from llama.cli.chat_input import BLOCK, CONTINUED, LineEditor, closest_command, load_dialog, read_message, save_dialog
from llama.decoding.speed import Stopwatch
from llama.distributed import several_processes
from llama.generation import Llama
from llama.tokenizer import Message
from llama.vision.batch import MAX_IMAGES

T = TypeVar("T")

# Waiting for a person to type is not a fault: the input broadcast gets its own, patient process group.
INPUT_TIMEOUT = timedelta(days=7)

COMMANDS = {
    "/help": "list these commands",
    "/reset": "clear the history (the system prompt stays)",
    "/system TEXT": "set the system prompt (/system alone removes it); the history stays",
    "/save FILE": "write the dialog to FILE as JSON",
    "/load FILE": "go on from a dialog /save wrote",
    "/image PATH": "attach the image file at PATH to the next message (a vision model)",
    "/exit": "quit (so does end of input, Ctrl-D)",
}
ENDED_BY_CTRL_C = "[Ctrl-C under torchrun: torchrun stops every process, so the chat ends here]"
CTRL_C = "\x03"  # what rank 0 hands the other ranks when Ctrl-C ends the chat at the prompt


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
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
        out: Optional[TextIO] = None,
    ):
        self.generator = generator
        self.system_prompt = system_prompt
        self.temperature, self.top_p, self.max_gen_len = temperature, top_p, max_gen_len
        self.out = out or sys.stdout  # looked up now, not when `ChatSession` was defined
        self.history: List[Message] = []
        self.images: List[ImagePart] = []  # attached by /image, waiting for the next message
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def set_system_prompt(self, system_prompt: Optional[str]) -> None:
        """Replace the system prompt (None: none), keeping the rest of the dialog."""
        rest = self.history[1:] if self.history and self.history[0]["role"] == "system" else self.history
        self.system_prompt = system_prompt
        self.reset()
        self.history += rest

    def load(self, dialog: List[Message]) -> None:
        """Go on from `dialog` (checked by `llama.cli.chat_input.load_dialog`); its system message, if any, becomes the
        system prompt."""
        self.system_prompt = dialog[0]["content"] if dialog and dialog[0]["role"] == "system" else None
        self.history = list(dialog)

    def answer_room(self) -> int:
        """Tokens kept free for the answer: max_gen_len, or a quarter of the context."""
        max_seq_len = self.generator.model.params.max_seq_len
        return min(self.max_gen_len or max_seq_len // 4, max_seq_len - 1)

    def trim_history(self) -> None:
        """Drop the oldest turns (never the system prompt or the newest message) until the dialog holds at most
        MAX_IMAGES images, as a vision model's prompt must, and the answer fits."""
        first = 1 if self.system_prompt else 0
        dropped = 0
        while image_count(self.history) > MAX_IMAGES and len(self.history) - first > 1:
            del self.history[first]
            dropped += 1
        if dropped:
            print(
                f"[more than {MAX_IMAGES} images in the dialog, the most the model reads: dropped the {dropped} "
                "oldest message(s)]",
                file=self.out,
                flush=True,
            )
        limit = self.generator.model.params.max_seq_len - self.answer_room()
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

    def send(self, content: Union[str, List[dict]]) -> str:
        """Add a user message (a text, or text and image parts), stream the answer to `out`, and return it (partial if
        interrupted)."""
        n_images = image_count([{"role": "user", "content": content}])
        if n_images > MAX_IMAGES:
            raise ValueError(f"This message has {n_images} images; the model reads at most {MAX_IMAGES}")
        self.history.append({"role": "user", "content": content})
        self.trim_history()
        pieces, n_tokens, stopwatch = [], 0, Stopwatch(self.generator.decoder)
        print("Assistant: ", end="", file=self.out, flush=True)
        try:
            for chunk in self.generator.chat_completion_stream(
                [self.history], self.temperature, self.top_p, self.max_gen_len
            ):
                pieces.append(chunk.text)
                n_tokens = chunk.n_tokens
                print(chunk.text, end="", file=self.out, flush=True)
        except ValueError:  # refused before answering (an image too long and thin to tile): the message goes
            self.history.pop()
            print(file=self.out)
            raise
        except KeyboardInterrupt:
            if several_processes():
                print(f"\n{ENDED_BY_CTRL_C}", file=self.out, flush=True)
                raise SystemExit(130) from None
            print("\n[stopped]", end="", file=self.out)
        speed = stopwatch.speed(n_tokens)  # compiling left out
        answer = "".join(pieces)
        self.history.append({"role": "assistant", "content": answer})
        print(f"\n{speed}", file=self.out)
        return answer


def shared(make: Callable[[], T], group) -> T:
    """`make()` computed by rank 0 and handed to every rank (all of them call this at the same point)."""
    value = [make() if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(value, src=0, group=group)
    return value[0]


def read_line(prompt: str, input_fn: Callable[[str], str], group) -> str:
    """Rank 0 reads a message, of one line or several (EOF means /exit); every rank gets it. Ctrl-C ends the chat:
    in one process as KeyboardInterrupt, under torchrun on every rank at once, with one line saying so."""

    def read() -> str:
        try:
            return read_message(prompt, input_fn)
        except EOFError:
            return "/exit"
        except KeyboardInterrupt:
            if not several_processes():
                raise
            print(f"\n{ENDED_BY_CTRL_C}", flush=True)
            return CTRL_C

    line = shared(read, group)
    if line == CTRL_C:
        raise SystemExit(130)
    return line


def run_chat(
    generator: Llama,
    system_prompt: Optional[str] = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_gen_len: Optional[int] = None,
    input_fn: Optional[Callable[[str], str]] = None,
    out: Optional[TextIO] = None,
) -> None:
    """Run the interactive chat until /exit or end of input. Lines are read with `input_fn`, by default `input` with
    line editing and history where the terminal allows (`llama.cli.chat_input.LineEditor`). The chat is written to `out`
    (default: stdout); under torchrun, where every rank computes the same answers, pass
    `llama.cli.common.rank0_stream(sys.stdout)` so that they are shown once."""
    out = out or sys.stdout
    group = dist.new_group(backend="gloo", timeout=INPUT_TIMEOUT) if dist.get_world_size() > 1 else None
    if input_fn is None:
        input_fn = LineEditor([usage.split()[0] for usage in COMMANDS]) if dist.get_rank() == 0 else input
    session = ChatSession(generator, system_prompt, temperature, top_p, max_gen_len, out)
    greeting = 'Chat with the model: /help lists the commands, /exit or Ctrl-D quits, """ starts a message of lines.'
    print(greeting, file=out)
    with ctrl_c_interrupts():
        while True:
            line = read_line("User: ", input_fn, group)
            if line == "/exit":
                break
            if line.startswith("/") and not line.startswith("//"):
                run_command(session, line, group)
            elif line:
                content = with_images(session, line[1:] if line.startswith("//") else line, group)
                try:
                    if content is not None:
                        session.send(content)
                except ValueError as e:
                    print(f"[{e}]", file=out)


def with_images(session: ChatSession, text: str, group) -> Union[str, List[dict], None]:
    """The user message `text` with its images: those /image attached, then, on a vision model, the files it names
    (each said in the chat as it is attached). None, with the reason said, where an image cannot be read or there
    are too many: then nothing is sent, and what /image attached waits for the next message."""
    found = shared(lambda: value_or_error(images_named_in, text), group) if takes_images(session.generator) else []
    if isinstance(found, str):
        print(f"[{found} The message was not sent.]", file=session.out)
        return None
    attached = {part.get("path") for part in session.images}
    found = [part for part in found if part.get("path") not in attached]  # named again after /image: once
    images = session.images + found
    if len(images) > MAX_IMAGES:
        print(
            f"[{len(images)} images for one message, more than the {MAX_IMAGES} the model reads. It was not sent.]",
            file=session.out,
        )
        return None
    for part in found:
        print(f"[{described(part)}]", file=session.out)
    session.images = []
    return user_content(text, images)


def run_command(session: ChatSession, line: str, group) -> None:
    """Carry out a /command; an unknown one is answered with the list, never sent to the model."""
    out = session.out
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    if name == "/help":
        print("\n".join(f"  {usage:14} {what}" for usage, what in COMMANDS.items()), file=out)
        print(f"  {'Ctrl-C':14} stop the answer being written; at the prompt, end the chat", file=out)
        print(f"  {'//text':14} send a message that starts with /", file=out)
        print(f"  {BLOCK:14} a line of its own: starts, and another ends, a message of several lines", file=out)
        print(f"  {'TEXT ' + CONTINUED:14} a line ending in {CONTINUED} goes on on the next one", file=out)
    elif name == "/reset":
        session.reset()
        session.images = []
        print("[history cleared]", file=out)
    elif name == "/system":
        session.set_system_prompt(argument or None)
        print(f"[system prompt {'set' if argument else 'removed'}]", file=out)
    elif name == "/image":
        attach_image(session, unquoted(argument), group)
    elif name in ("/save", "/load") and not argument:
        print(f"[{name} needs a file name: {name} FILE]", file=out)
    elif name == "/save":
        error = shared(lambda: saving_error(argument, saved_dialog(session.history)), group)  # rank 0 writes
        n_images = image_count(session.history)
        images = f" ({n_images} image(s) by their paths)" if n_images else ""
        print(f"[{error}]" if error else f"[saved {len(session.history)} messages to {argument}{images}]", file=out)
    elif name == "/load":
        loaded = shared(lambda: loading(argument), group)  # rank 0 reads; every rank gets the dialog
        if isinstance(loaded, str):
            print(f"[{loaded}]", file=out)
        elif image_count(loaded) and not takes_images(session.generator):
            print(f"[{argument} holds images, and this model takes no images: it is a text model]", file=out)
        else:
            session.load(loaded)
            print(f"[loaded {len(loaded)} messages from {argument}]", file=out)
    else:
        names = [usage.split()[0] for usage in COMMANDS]
        guess = closest_command(name, names)
        hint = f" Did you mean {guess}?" if guess else ""
        print(f"[unknown command {name[:40]}.{hint} The commands: {', '.join(names)}]", file=out)


def attach_image(session: ChatSession, path: str, group) -> None:
    """/image PATH: read the image now, so that a bad file is said at once, and keep it for the next message."""
    out = session.out
    if not takes_images(session.generator):
        print("[This model takes no images: it is a text model. /image needs a Llama 3.2 Vision checkpoint]", file=out)
    elif not path:
        print("[/image needs a file name: /image PATH]", file=out)
    elif len(session.images) >= MAX_IMAGES:
        print(f"[{MAX_IMAGES} images wait for the next message already, the most the model reads]", file=out)
    else:
        part = shared(lambda: value_or_error(open_attachment, path), group)  # rank 0 reads; every rank gets it
        if isinstance(part, str):
            print(f"[{part}]", file=out)
        else:
            session.images.append(part)
            print(f"[{described(part)}: it goes with the next message]", file=out)


def value_or_error(function: Callable[[str], T], argument: str) -> Union[T, str]:
    """`function(argument)`, or the text of the ValueError it raised: what rank 0 can hand the other ranks."""
    try:
        return function(argument)
    except ValueError as e:
        return str(e)


def saving_error(path: str, dialog: List[Message]) -> Optional[str]:
    try:
        save_dialog(path, dialog)
    except ValueError as e:
        return str(e)
    return None


def loading(path: str):
    """The dialog in `path`, its images read, or the text of what is wrong with it."""
    try:
        return opened_dialog(load_dialog(path), path)
    except ValueError as e:
        return str(e)
