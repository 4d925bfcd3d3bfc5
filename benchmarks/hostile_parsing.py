"""Reading hostile answers: how long `ChatFormat.decode_assistant_message_from_content` takes on text built to make
a parser backtrack or rescan (every tool-call form, the built-in calls, the python tag), at 64 kB and at the sizes
where the regex it replaced hung.

    python benchmarks/hostile_parsing.py                 # every shape at 64 kB, plus the issue's sizes
    python benchmarks/hostile_parsing.py --kb 256        # a larger size, to see that time grows linearly

For each shape it prints its length, the best and worst of `--repeats` reads, and how many tool calls came out.
The tokenizer is only used for its special tokens; the text never goes through tiktoken here.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import find_tokenizer_path  # noqa: E402

from llama import ChatFormat, Tokenizer  # noqa: E402


def repeated(piece: str, size: int, before: str = "", after: str = "") -> str:
    """`piece` repeated to fill about `size` characters, between `before` and `after`."""
    return before + piece * max(1, size // len(piece)) + after


def shapes(size: int) -> dict:
    """Adversarial answers of about `size` characters, by what they attack."""
    return {
        "<function=x>{ repeated": repeated("<function=x>{", size),
        "<function= repeated": repeated("<function=", size),
        ">{ after one <function=": repeated(">{", size, "<function="),
        "<function=x>{ + line breaks, one }": repeated("<function=x>{\n", size, after="}"),
        "<function=f> + nested JSON": repeated('{"a": ', size, "<function=f>", "}"),
        "<function=f>{ + quotes": repeated("'", size, "<function=f>{", "}"),
        "JSON object nested": repeated('{"a": ', size),
        "JSON number": repeated("1", size, '{"a": ', "}"),
        "list of calls, unclosed": repeated("[f(", size),
        "list of 16k calls": repeated("f(),", size, "[", "]"),
        "one call, 16k arguments": repeated("x=1,", size, "[f(", ")]"),
        "statements": repeated("j,;", size),
        "unary minus nested": repeated("-", size, "[f(x=", "1)]"),
        'x.call(query=" repeated': repeated('x.call(query="', size),
        "one long word before .call": repeated("a", size, after='.call(query="'),
        "python tag + <function=x>{": repeated("<function=x>{", size, "<|python_tag|>"),
        "mixed fragments": repeated('<function=[f({"a": \'b.call(query="', size),
    }


def issue_shapes() -> dict:
    """The sizes at which the old pattern was measured (issue 36)."""
    return {
        "<function=x>{ x 800": "<function=x>{" * 800,
        "<function=x>{ x 2,500": "<function=x>{" * 2500,
        "<function= x 8,000": "<function=" * 8000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb", type=int, default=64, help="size of each shape in kB (1,000 characters)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    chat = ChatFormat(Tokenizer(find_tokenizer_path(), version="3.1"))
    print(f"{'shape':38s} {'chars':>8s} {'best ms':>9s} {'worst ms':>9s} {'calls':>6s}")
    for name, text in {**shapes(args.kb * 1000), **issue_shapes()}.items():
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            message = chat.decode_assistant_message_from_content(text, "end_of_turn")
            times.append((time.perf_counter() - start) * 1e3)
        print(f"{name:38s} {len(text):8,d} {min(times):9.1f} {max(times):9.1f} {len(message['tool_calls']):6d}")


if __name__ == "__main__":
    main()
