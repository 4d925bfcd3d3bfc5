"""The `llama` command (also `python -m llama`): one command line over the library, in argparse's style.

    llama chat CKPT_DIR                 chat in the terminal (docs/chat.md)
    llama complete CKPT_DIR [PROMPT]    continue PROMPT (or stdin) and stream the text to stdout; --image PATH
                                        (repeatable) starts the prompt with images, on a Llama 3.2 Vision model
    llama serve ...                     the HTTP server (`llama.serve`)
    llama convert ...                   convert or quantize a checkpoint (`llama.cli.convert`)
    llama demo DIR                      write a small random-weight checkpoint to try things on (`llama.cli.demo`)
    llama --version

`chat` and `complete` take the example scripts' flags by the same names (`--max_seq_len`, `--temperature`, ...).
Everything but the generated text goes to stderr: the line saying what was loaded, the speed, log records
(`--verbose` for all of them). Ctrl-C ends any command with one line and exit status 130.
"""

import argparse
import difflib
import importlib
import os
import sys
from typing import List, Optional

from llama import __version__
from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, check_sampling
from llama.cli.common import (
    add_compile_flags,
    add_draft_flags,
    build_from_flags,
    check_prompts_fit,
    checkpoint_takes_images,
    ends_on_ctrl_c,
    fail,
    rank0_stream,
    user_errors,
)
from llama.logs import show_logs

PROG = "llama"

# Commands that are another module's own command line, handed the rest of the arguments as they are.
DELEGATED = {
    "serve": ("llama.serve", "run the HTTP server (llama serve -h for its flags)"),
    "convert": ("llama.cli.convert", "convert a checkpoint between Meta's and Hugging Face's layouts, or quantize it"),
    "demo": ("llama.cli.demo", "write a small random-weight checkpoint with the real tokenizer, to try things on"),
}


CHAT_HELP = (
    "Chat with an Instruct model. Type /help in the chat for its commands; a line ending in \\ or a block between "
    '""" lines is one message. Ctrl-C stops an answer; at the prompt, Ctrl-C or Ctrl-D ends the chat.'
)
COMPLETE_HELP = "Continue PROMPT (or what stdin holds) with a base model; the new text streams to stdout."


def add_model_flags(parser: argparse.ArgumentParser, max_gen_len: Optional[int]) -> None:
    """The flags `chat` and `complete` share: where the model is, how it runs, how it samples."""
    parser.add_argument("ckpt_dir", help="checkpoint: a Meta or Hugging Face folder, a GGUF file, or ollama:NAME[:TAG]")
    parser.add_argument("--tokenizer_path", help="the tokenizer.model file (default: looked for in ckpt_dir)")
    parser.add_argument("--max_seq_len", type=int, default=2048, help="tokens the KV cache holds (default 2048)")
    parser.add_argument("--max_batch_size", type=int, default=1, help="rows of the KV cache (default 1)")
    shipped = "the checkpoint's generation_config.json, else"
    default = "no limit but max_seq_len" if max_gen_len is None else max_gen_len
    parser.add_argument("--max_gen_len", type=int, help=f"most new tokens (default: {shipped} {default})")
    parser.add_argument("--temperature", type=float, help=f"0 is greedy (default: {shipped} {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top_p", type=float, help=f"nucleus sampling threshold (default: {shipped} {DEFAULT_TOP_P})")
    parser.set_defaults(
        sampling_defaults={"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "max_gen_len": max_gen_len}
    )
    parser.add_argument("--seed", type=int, default=1, help="seed for sampling (default 1)")
    parser.add_argument("--device", help="cuda, cuda:N, cpu or mps (default: CUDA if present, else the CPU)")
    parser.add_argument("--dtype", help="bfloat16, float16 or float32 (default: by device and checkpoint)")
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4"],  # llama.quantize's, named here: --help needs no torch
        help="quantize as the weights load: int8 or int4 weights",
    )
    add_compile_flags(parser)
    parser.add_argument(
        "--nocuda_graphs", dest="cuda_graphs", action="store_false", help="on one GPU, decode without CUDA graphs"
    )
    parser.add_argument(
        "--noprefix_cache",
        dest="prefix_cache",
        action="store_false",
        help="run each prompt from its first token, as Meta's code does (default: reuse what the KV cache holds from "
        "the last turn: in float32 the same greedy tokens; in bfloat16 a near-tie may break otherwise, and a seeded "
        "sample can differ from a cold run's; a vision model reuses what comes before a prompt's first image)",
    )
    add_draft_flags(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the library's log records (INFO)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run Llama 3 checkpoints: chat, complete text, serve, convert.",
        epilog="Run `llama COMMAND -h` for a command's flags. Guide: docs/chat.md.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chat = commands.add_parser("chat", help="chat with an Instruct model in the terminal", description=CHAT_HELP)
    add_model_flags(chat, max_gen_len=None)
    chat.add_argument("--system_prompt", help="a system message that opens the conversation")
    chat.set_defaults(command_parser=chat)
    complete = commands.add_parser(
        "complete", help="continue a text and stream it to stdout", description=COMPLETE_HELP
    )
    add_model_flags(complete, max_gen_len=256)
    complete.add_argument("prompt", nargs="?", help="the text to continue; read from stdin when left out or -")
    complete.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="an image file the prompt starts with, before its text (a Llama 3.2 Vision model); repeat the flag for "
        "several, in order",
    )
    complete.set_defaults(command_parser=complete)
    for name, (_, help_text) in DELEGATED.items():  # listed in `llama -h`; their flags are their own
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def long_flags(parser: argparse.ArgumentParser) -> List[str]:
    """The `--flags` of `parser` and of its commands, each once and without its dashes (`max_seq_len`,
    `nocuda_graphs`); -h and -V, which no message of the library names, are left out."""
    names = []
    for action in parser._actions:  # argparse lists a parser's arguments nowhere public
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        names += [option[2:] for option in action.option_strings if option.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for command_parser in action.choices.values():
                names += long_flags(command_parser)
    return list(dict.fromkeys(names))


# Every flag of `chat` and `complete`: a message from the library that names one (`max_seq_len=...`) is shown with it
# as a flag (`--max_seq_len`), and `--max-seq-len` is read as `--max_seq_len`. "image" is a word many messages
# use as a word ("not an image file"): a message about the flag names it as `--image` itself.
FLAGS = long_flags(build_parser())
NAMED_IN_MESSAGES = [flag for flag in FLAGS if flag != "image"]


def main(argv: Optional[List[str]] = None) -> None:
    """The `llama` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with ends_on_ctrl_c():
        if argv and argv[0] in DELEGATED:
            run_delegated(argv[0], argv[1:])
            return
        args, unknown = build_parser().parse_known_args(with_underscores(argv))
        if unknown:  # said with the command's usage, not the top level's, and the flag meant if it is a typo
            args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{flag_hint(unknown)}")
        show_logs(args.verbose)
        with user_errors(NAMED_IN_MESSAGES):
            if args.command == "chat":
                chat(args)
            else:
                complete(args)


def with_underscores(argv: List[str]) -> List[str]:
    """`argv` with flags spelt with dashes (`--max-seq-len`, as the example scripts also take them) written as the
    flags are named (`--max_seq_len`); any other argument is left as it is."""
    spelt = []
    for arg in argv:
        name, equals, value = arg.partition("=")
        flag = name[2:].replace("-", "_")
        spelt.append(f"--{flag}{equals}{value}" if name.startswith("--") and flag in FLAGS else arg)
    return spelt


def flag_hint(unknown: List[str]) -> str:
    """The hint " (did you mean --max_seq_len?)" for the first of `unknown` close to a flag, else ""."""
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg[2:].partition("=")[0], FLAGS, n=1, cutoff=0.6)
            if close:
                return f" (did you mean --{close[0]}?)"
    return ""


def run_delegated(command: str, argv: List[str]) -> None:
    module_name = DELEGATED[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        fail(f"`llama {command}` is not available in this installation ({module_name} is missing)")
    show_logs()
    module.main(argv, prog=f"{PROG} {command}")


def load(args: argparse.Namespace, prompts: Optional[List[str]] = None):
    """Check what can be checked without the weights, then build the Llama and say what was loaded (stderr)."""
    check_flags(args, prompts)
    return build_from_flags(args)


def check_flags(args: argparse.Namespace, prompts: Optional[List[str]] = None) -> None:
    """Check the sampling flags, and `prompts` (texts) against --max_seq_len and --max_batch_size; fill in the
    sampling flags left out with the checkpoint's defaults, else the command's."""
    flags = vars(args)
    # The sampling flags given are checked first: reading the checkpoint imports torch, seconds before a mistake
    # could be reported.
    given = {name: flags[name] for name in args.sampling_defaults if flags[name] is not None}
    check_sampling(**{**args.sampling_defaults, **given})
    from llama.checkpoint import generation_defaults

    # A flag left out takes the checkpoint's own default (its generation_config.json), else the command's.
    shipped = generation_defaults(args.ckpt_dir)
    for name, default in args.sampling_defaults.items():
        if flags[name] is None:
            flags[name] = shipped.get(name, default)
    check_sampling(args.temperature, args.top_p, args.max_gen_len)
    if prompts is not None:
        check_prompts_fit(args.ckpt_dir, args.tokenizer_path, prompts, args.max_seq_len, args.max_batch_size)


def chat(args: argparse.Namespace) -> None:
    generator = load(args)
    from llama.cli.chat import run_chat  # imported after the flags are checked, as it imports torch

    out = rank0_stream(sys.stdout)  # every process computes the same answers; the first one shows them
    run_chat(generator, args.system_prompt, args.temperature, args.top_p, args.max_gen_len, out=out)


def complete(args: argparse.Namespace) -> None:
    prompt = None if args.prompt == "-" else args.prompt  # "-": stdin, as for many commands
    if prompt is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("Under torchrun every process needs the prompt: give it as an argument, not on stdin")
    if prompt is None:
        if sys.stdin.isatty():
            print("Reading the prompt from stdin; end it with Ctrl-D.", file=sys.stderr, flush=True)
        prompt = sys.stdin.read().removesuffix("\n")  # the newline `echo` and editors end a file with
    if not prompt:
        raise ValueError("The prompt is empty; give it as an argument or on stdin")
    check_flags(args, [prompt])  # the text's tokens; each image adds one, which the Llama counts
    if args.image:
        prompt = with_images(args.ckpt_dir, args.image, prompt)
    generator = build_from_flags(args)
    from llama.decoding.speed import Stopwatch  # imported after the flags are checked, as it imports torch

    out = rank0_stream(sys.stdout)  # every process computes the same text; the first one shows it
    stopwatch = Stopwatch(generator.decoder)
    n_tokens = 0
    try:
        for chunk in generator.text_completion_stream([prompt], args.temperature, args.top_p, args.max_gen_len):
            out.write(chunk.text)
            out.flush()
            n_tokens = chunk.n_tokens
    finally:  # the text ends its line, also when Ctrl-C cuts it short
        out.write("\n")
        out.flush()
    print(stopwatch.speed(n_tokens), file=rank0_stream(sys.stderr))


def with_images(ckpt_dir: str, paths: List[str], text: str) -> list:
    """The prompt of `--image` files and `text`: the images' parts, in order, then the text's, each image read now,
    before the weights load, so that a missing or damaged file is said at once."""
    from llama.cli.chat_images import open_attachment  # the chat's /image: the same one-line errors
    from llama.vision.batch import MAX_IMAGES

    if not checkpoint_takes_images(ckpt_dir):
        raise ValueError(
            f"This model takes no images: {ckpt_dir} holds a text model. --image needs a Llama 3.2 Vision checkpoint"
        )
    if len(paths) > MAX_IMAGES:
        raise ValueError(f"{len(paths)} --image files; the model reads at most {MAX_IMAGES}")
    return [*(open_attachment(path) for path in paths), {"type": "text", "text": text}]
