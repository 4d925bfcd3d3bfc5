"""Llama 3's vocabulary as a GGUF file holds it (`tokenizer.ggml.*`): each token's bytes written as GPT-2's
printable characters, its ID its place in the list, the special tokens after the 128000 BPE ones, and the merges
that llama.cpp's BPE runs. tiktoken needs only the ranks, which for Llama 3 are the IDs; the merges are written for
llama.cpp and transformers, which read them.
"""

import functools
import os
from typing import Dict, List, Sequence, Tuple

GGUF_TOKENIZER_MODEL = "gpt2"  # llama.cpp's name for byte-level BPE
GGUF_PRE_TOKENIZER = "llama-bpe"  # llama.cpp's name for Llama 3's pre-tokenizer (the split pattern)
NORMAL, CONTROL = 1, 3  # tokenizer.ggml.token_type values: a BPE token, a special one
GGUF_MAGIC = b"GGUF"
GGUF_INSTALL = "pip install 'llama3[gguf]' (from a checkout: pip install -e '.[gguf]')"


def is_gguf_file(path) -> bool:
    """Whether `path` is a local file that begins as a GGUF file does."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_reader(path):
    """A `gguf.GGUFReader` of `path` (memory-mapped: nothing is read until asked for), or a ValueError naming the
    file when the gguf package is missing or the file is not a complete GGUF file."""
    try:
        reader_class = plain_array_reader()
    except ImportError:
        raise ValueError(f"Reading GGUF files needs the gguf package: {GGUF_INSTALL}") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it begins with {magic!r}, not {GGUF_MAGIC!r}")
    try:
        return reader_class(path)
    except Exception as e:  # what a damaged header makes the reader raise: struct, numpy and value errors
        raise ValueError(f"{path} is not a readable GGUF file ({e}): it is truncated or damaged") from None


@functools.lru_cache(maxsize=None)
def plain_array_reader():
    """`gguf.GGUFReader`, reading through a plain numpy view of its memory map. The reader slices the map once per
    metadata value, and a slice of a `numpy.memmap` runs the memmap's bookkeeping each time: three quarters of the
    time Llama 3's vocabulary takes to read (its 128256 tokens and 127066 merges). A plain view of the same memory
    reads the same bytes without it."""
    import gguf
    import numpy as np

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)  # the memmap stays alive as the view's base

    return PlainArrayReader


def metadata(reader, name: str):
    """The value of a GGUF file's metadata key `name` (None where the file has none)."""
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def read_gguf_ranks(path, reader=None) -> Dict[bytes, int]:
    """`gguf_bpe_ranks` of the vocabulary in the GGUF file at `path` (read through `reader`, where it is open)."""
    reader = reader or gguf_reader(path)
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise ValueError(f"{path} holds no vocabulary (tokenizer.ggml.tokens); pass tokenizer_path")
    kinds = metadata(reader, "tokenizer.ggml.token_type") or []
    model, pre = metadata(reader, "tokenizer.ggml.model"), metadata(reader, "tokenizer.ggml.pre")
    return gguf_bpe_ranks(path, tokens, kinds, model, pre)


@functools.lru_cache(maxsize=None)
def printable_of_byte() -> Dict[int, str]:
    """GPT-2's map from each byte to a printable character: printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=None)
def byte_of_printable() -> Dict[str, int]:
    return {char: byte for byte, char in printable_of_byte().items()}


def token_text(token: bytes) -> str:
    """A BPE token's bytes as a GGUF vocabulary writes them."""
    table = printable_of_byte()
    return "".join(table[b] for b in token)


def token_bytes(text: str, where: str) -> bytes:
    """A GGUF vocabulary entry's bytes; a ValueError naming `where` for a character that stands for no byte."""
    table = byte_of_printable()
    try:
        return bytes(table[char] for char in text)
    except KeyError as e:
        raise ValueError(f"{where}: {text!r} is not a byte-level BPE token (character {e.args[0]!r})") from None


def gguf_bpe_ranks(path, tokens: Sequence[str], kinds: Sequence[int], model: str, pre: str) -> Dict[bytes, int]:
    """The BPE ranks of a GGUF file's Llama 3 vocabulary (`tokens`, their `kinds`, the tokenizer `model` and `pre`
    names): its normal tokens, which come first, each ID its rank. The special tokens after them are the
    tokenizer's own (`Tokenizer`), at the same IDs.

    Raises:
        ValueError: naming `path`, for a vocabulary of another family or a damaged one.
    """
    if model != GGUF_TOKENIZER_MODEL or pre != GGUF_PRE_TOKENIZER:
        raise ValueError(
            f"{path} holds a {model!r} tokenizer with pre-tokenizer {pre!r}; the tokenizer is read from a GGUF of the "
            f"Llama 3 family only ({GGUF_TOKENIZER_MODEL!r}, {GGUF_PRE_TOKENIZER!r}): pass tokenizer_path"
        )
    if len(kinds) != len(tokens):
        raise ValueError(f"{path}: {len(tokens)} tokens but {len(kinds)} token types; the file is damaged")
    n_base = next((i for i, kind in enumerate(kinds) if kind != NORMAL), len(kinds))
    ranks = {}
    for rank in range(n_base):
        token = token_bytes(tokens[rank], f"{path}: token {rank}")
        if ranks.setdefault(token, rank) != rank:
            raise ValueError(f"{path}: tokens {ranks[token]} and {rank} are the same bytes; the file is damaged")
    return ranks


def bpe_merges(ranks: Dict[bytes, int]) -> List[Tuple[bytes, bytes]]:
    """The merges, in rank order, that build each multi-byte token from the two lower-ranked tokens BPE joins
    last: running BPE on its bytes with only the tokens ranked below it leaves exactly those two."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges
