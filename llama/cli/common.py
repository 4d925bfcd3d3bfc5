"""What the command-line entry points share: flags checked before anything runs, a user's mistake reported as
one line that names the flag to change, not as a traceback, Ctrl-C as one line and exit status 130, and what
every process computes alike shown once, by the first (`rank0_stream`).

A user's mistake is what the library raises as `ValueError`, `FileNotFoundError` or `FileExistsError` (a missing
folder, a device that is not here, a value out of range). Any other exception is a bug, and keeps its traceback.
"""

import argparse
import functools
import inspect
import os
import re
import sys
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, TextIO

import fire

from llama.arguments import DEFAULT_DRAFT_MAX
from llama.logs import show_logs

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)
INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a program that Ctrl-C ended


def run(main: Callable, argv: Optional[List[str]] = None) -> None:
    """Run `main` as a fire command line, after checking that every flag in `argv` (default: sys.argv) is one of
    its parameters: fire itself reports a mistyped flag only once `main` has run to the end."""
    argv = sys.argv[1:] if argv is None else argv
    parameters = inspect.signature(main).parameters
    unknown = unknown_flags(argv, parameters)
    if unknown:
        valid = ", ".join(f"--{name}" for name in parameters)
        fail(f"unknown flag{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the flags are: {valid}")
    show_logs()
    with ends_on_ctrl_c(), user_errors(parameters):
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


@contextmanager
def ends_on_ctrl_c() -> Iterator[None]:
    """Ctrl-C inside ends the program with one line on stderr (from the first process only, under torchrun) and exit
    status 130, instead of a traceback per process.

    It ends the process at once (`os._exit`), after flushing its output: an interrupt can land anywhere, and an
    orderly exit then may wait forever for a worker thread it left waiting (a thread pool of the CPU kernels), or
    end by SIGINT all the same (CPython 3.11 remembers a KeyboardInterrupt that passed through code it built from
    a string, such as a dataclass's methods, and re-raises the signal at exit even though it was caught). Nothing
    is left unwritten: the chat saves its history after each line, and files are written whole or not at all."""
    try:
        yield
    except KeyboardInterrupt:
        start_of_line = "\n" if sys.stderr.isatty() else ""  # a terminal's cursor is after the prompt, or ^C
        print(f"{start_of_line}Interrupted (Ctrl-C)", file=rank0_stream(sys.stderr), flush=True)
        sys.stdout.flush()
        os._exit(INTERRUPTED_EXIT_STATUS)


def check_prompts_fit(
    ckpt_dir: str, tokenizer_path: Optional[str], prompts: Sequence, max_seq_len: int, max_batch_size: int
) -> None:
    """Raise the ValueError that generating `prompts` (texts, or dialogs) would raise for too small a max_batch_size
    or max_seq_len, from the tokenizer alone: before the weights load, not after."""
    from llama.checkpoint import find_tokenizer
    from llama.tokenizer import ChatFormat, Tokenizer

    kind = "dialog" if prompts and not isinstance(prompts[0], str) else "prompt"
    if isinstance(max_batch_size, int) and 1 <= max_batch_size < len(prompts):
        raise ValueError(f"{len(prompts)} {kind}s exceed max_batch_size={max_batch_size}; raise max_batch_size")
    if not isinstance(max_seq_len, int) or max_seq_len < 1 or not os.path.isdir(ckpt_dir):
        return  # Llama.build says what is wrong
    try:
        tokenizer = Tokenizer(find_tokenizer(ckpt_dir, tokenizer_path))
    except (FileNotFoundError, ValueError):
        return  # as Llama.build will, in its order
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            n_tokens = len(tokenizer.encode(prompt, bos=True, eos=False))
        else:
            n_tokens = len(ChatFormat(tokenizer).encode_dialog_prompt(prompt))
        if n_tokens > max_seq_len:
            which = f"The {kind}" if len(prompts) == 1 else f"{kind.capitalize()} {i}"
            raise ValueError(
                f"{which} is {n_tokens} tokens long, longer than max_seq_len={max_seq_len}; raise max_seq_len"
            )


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def rank0_stream(stream: TextIO) -> TextIO:
    """`stream` in the first process, a stream that drops what is written in any other.

    Under torchrun every process computes the same text, so the command lines show it, and say what was loaded and
    how fast, from global rank 0 only: print with `file=rank0_stream(sys.stdout)` (or `sys.stderr`). The rank is
    torchrun's RANK, read without torch, so that this works before torch has loaded (Ctrl-C during the imports);
    without torchrun there is one process, and it shows everything.
    """
    return stream if os.environ.get("RANK", "0") == "0" else _devnull()


@functools.lru_cache(maxsize=None)
def _devnull() -> TextIO:
    """The null device, opened once, for what the other processes would have shown."""
    return open(os.devnull, "w")


def add_compile_flags(parser: argparse.ArgumentParser) -> None:
    """`--compile` and `--nocompile`, for `Llama.build(compile=...)`: True, False, or None (left out: the runtime
    compiles quantized weights on one CUDA GPU only)."""
    parser.add_argument(
        "--compile",
        action="store_const",
        const=True,
        help="decode through torch.compile, slow to start (default: for quantized weights on one CUDA GPU only)",
    )
    parser.add_argument("--nocompile", dest="compile", action="store_const", const=False, help="never compile")


def add_draft_flags(parser: argparse.ArgumentParser) -> None:
    """`--draft`, `--draft_max` and `--draft_quantize`, for `Llama.build`'s arguments of the same names."""
    parser.add_argument(
        "--draft",
        help='decode speculatively, guessing several tokens a step and keeping those the model agrees with: "lookup" '
        "guesses from the text so far; a checkpoint folder is a draft model with the same tokenizer. Greedy answers "
        "are the model's own (docs/speed.md)",
    )
    parser.add_argument(
        "--draft_max",
        type=int,
        default=DEFAULT_DRAFT_MAX,
        help=f"most guessed tokens checked in one step (default {DEFAULT_DRAFT_MAX})",
    )
    parser.add_argument("--draft_quantize", choices=["int8", "int4"], help="quantize the draft model as it loads")


# `Llama.build`'s keyword arguments that a command line may carry as flags of the same names.
BUILD_FLAGS = (
    "seed",
    "device",
    "dtype",
    "compile",
    "quantize",
    "cuda_graphs",
    "prefix_cache",
    "draft",
    "draft_max",
    "draft_quantize",
)


def build_from_flags(args):
    """`Llama.build` on a command line's parsed flags (`ckpt_dir`, `tokenizer_path`, `max_seq_len`,
    `max_batch_size`, and those of `BUILD_FLAGS` it has), then what was loaded said on rank 0's stderr."""
    from llama.generation import Llama

    options = {name: getattr(args, name) for name in BUILD_FLAGS if hasattr(args, name)}
    generator = Llama.build(args.ckpt_dir, args.tokenizer_path, args.max_seq_len, args.max_batch_size, **options)
    print(generator.load_report, file=rank0_stream(sys.stderr), flush=True)
    return generator


def checkpoint_takes_images(ckpt_dir: str) -> bool:
    """Whether `ckpt_dir` holds a Llama 3.2 Vision model (Meta's params.json, or a Hugging Face Mllama config.json,
    read as params: `vision_chunk_size` set), before any weight is read; False where the folder cannot be read, and
    `Llama.build` then says what is wrong."""
    from llama.checkpoint import open_checkpoint
    from llama.vision.model import holds_vision_model

    try:
        return holds_vision_model(open_checkpoint(ckpt_dir).params)
    except (ValueError, OSError):
        return False
