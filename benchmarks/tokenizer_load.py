"""What checking tokenizer.model costs at load: `load_bpe_ranks` (the ranks 0 to n - 1, each token once, every
byte a token) against the same file parsed without any check, and the whole `Tokenizer` load.

    python benchmarks/tokenizer_load.py                     # the Llama 3 tokenizer.model of tests/helpers.py
    python benchmarks/tokenizer_load.py --path tokenizer.model --repeats 20

Prints the best of `--repeats` runs of each, in milliseconds. The unchecked parse is the one-split reading this
library used before the checks (the fastest way we know to read the file at all); a file in another layout than
Meta's is read line by line, which the last row times.
"""

import argparse
import binascii
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import find_tokenizer_path  # noqa: E402

from llama.tokenizer.bpe import Tokenizer, _ranks_line_by_line, load_bpe_ranks  # noqa: E402


def unchecked_ranks(path: str) -> dict:
    data = Path(path).read_bytes()
    fields = data.split()
    return dict(zip(map(binascii.a2b_base64, fields[0::2]), map(int, fields[1::2])))


def best_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="a tokenizer.model (default: the Llama 3 one of the tests)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    path = args.path or find_tokenizer_path()
    data = Path(path).read_bytes()
    rows = {
        "unchecked parse": lambda: unchecked_ranks(path),
        "load_bpe_ranks (checked)": lambda: load_bpe_ranks(path),
        "Tokenizer(path), all of it": lambda: Tokenizer(path),
        "line by line (other layouts)": lambda: _ranks_line_by_line(data, path),
    }
    print(f"{path}: {len(data):,} bytes; best of {args.repeats}")
    for name, call in rows.items():
        print(f"{name:30s} {best_ms(call, args.repeats):7.1f} ms")


if __name__ == "__main__":
    main()
