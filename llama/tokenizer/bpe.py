"""The tokenizer: Llama 3's byte-level BPE ranks read from tokenizer.model (hostile input: checked, in linear
time), run by tiktoken, and the special tokens of each Llama version."""

import binascii
import functools
import os
import re
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from logging import getLogger
from pathlib import Path
from typing import Literal, Optional

import tiktoken

from llama.arguments import short_repr, token_id_list
from llama.tokenizer import files
from llama.tokenizer.gguf_vocab import is_gguf_file, read_gguf_ranks

logger = getLogger(__name__)

SUPPORTED_VERSIONS = ("3", "3.1")
# Maximal runs of whitespace, or of anything else; see Tokenizer._split_whitespaces_or_nonwhitespaces.
_RUNS = re.compile(r"\s+|\S+")


def _special_token_names(version: str, num_reserved: int) -> list[str]:
    """Names of the special tokens, in ID order, as the given Llama version calls them.

    Llama 3.1 renames some of Llama 3's reserved tokens; every ID keeps its position, and the tokens left
    reserved are renumbered consecutively.
    """
    if version == "3":
        named = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|reserved_special_token_2|>",
            "<|reserved_special_token_3|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|reserved_special_token_4|>",
            "<|eot_id|>",  # end of turn
        ]
        first_reserved = 5
    else:
        named = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>",
            "<|step_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",  # end of message (a tool call awaits its result)
            "<|eot_id|>",  # end of turn
            "<|python_tag|>",
            "<|image|>",
        ]
        first_reserved = 2
    reserved = [f"<|reserved_special_token_{first_reserved + i}|>" for i in range(num_reserved - len(named))]
    return named + reserved


def load_bpe_ranks(path: str) -> dict[bytes, int]:
    """The BPE merge ranks of a tiktoken model file: one `<base64 token> <rank>` per line, the ranks 0 to n - 1
    each used once, and a token for each of the 256 bytes (byte-level BPE starts from single bytes). A local GGUF
    file's vocabulary is read too (`llama.tokenizer.gguf_vocab`).

    What `tiktoken.load.load_tiktoken_bpe` returns for a sound file, read from `path` itself: tiktoken keeps a copy
    of every file it loads in the temp folder, keyed by its path, and reads that copy thereafter, so a file replaced
    in place would be ignored. Checked here, because tiktoken trusts the file: a rank used twice makes its Rust core
    panic (a BaseException), a rank gap or a token listed twice gives an ordinary token the ID of a special one.

    The bytes come through `llama.tokenizer.files`, so `path` may be local or a blobfile URL (`gs://...`, `az://...`).

    Raises:
        FileNotFoundError: If nothing exists at `path`.
        ValueError: If the file cannot be read or is not as above; the message names the first bad line.
    """
    if is_gguf_file(path):
        ranks = read_gguf_ranks(path)
    else:
        try:
            data = files.read_bytes(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"Tokenizer model file not found: {path}") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"Cannot read the tokenizer model file {path}: {e}") from e
        ranks = _ranks_in_meta_layout(data)
        if ranks is None:
            ranks = _ranks_line_by_line(data, path)
    missing = [bytes([b]) for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{path} is not a byte-level BPE file: it has no token for {len(missing)} of the 256 bytes "
            f"(the first: {missing[0]!r}); is it a tokenizer.model of Llama 3?"
        )
    return ranks


_strict_base64 = functools.partial(binascii.a2b_base64, strict_mode=True)
# Every byte but ASCII whitespace (what bytes.split() splits on): deleting them leaves a file's separators.
_NOT_WHITESPACE = bytes(b for b in range(256) if not bytes([b]).isspace())


def _ranks_in_meta_layout(data: bytes) -> Optional[dict[bytes, int]]:
    """The ranks of a file laid out exactly as Meta's: "<base64 token> <rank>\n" with ranks 0, 1, 2, ... in order
    and no token twice; None for any other file, which `_ranks_line_by_line` then reads (or names its bad line).

    Faster than reading line by line: each check runs over the whole file at once (docs/speed.md).
    """
    fields = data.split()
    n = len(fields) // 2
    # Once the non-whitespace is gone, one space and one newline per line remain, if each line is two fields.
    if data[:1].isspace() or data.translate(None, _NOT_WHITESPACE) != b" \n" * n or len(fields) != 2 * n:
        return None
    rank_fields = fields[1::2]
    try:  # int() refuses a number of more than 4300 digits; binascii.Error is a ValueError too
        if not b"".join(rank_fields).isdigit() or list(map(int, rank_fields)) != list(range(n)):
            return None
        ranks = dict(zip(map(_strict_base64, fields[0::2]), range(n)))
    except ValueError:
        return None
    return ranks if len(ranks) == n and b"" not in ranks else None


def _ranks_line_by_line(data: bytes, path: str) -> dict[bytes, int]:
    """The ranks of a tiktoken BPE file in any layout tiktoken reads (empty lines skipped, any whitespace between
    the fields), or a ValueError naming `path` and the first line that breaks the format."""
    lines = data.splitlines()
    n = len(lines) - lines.count(b"")
    ranks: dict[bytes, int] = {}
    line_of_token: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        fields = line.split()
        problem = None
        if len(fields) != 2:
            problem = "does not hold exactly two fields"
        elif not fields[1].isdigit():
            problem = "has a rank that is not a whole number"
        elif len(fields[1].lstrip(b"0")) > len(str(n)) or int(fields[1]) >= n:  # no int() of a huge number
            problem = f"has rank {fields[1][:30].decode()}, outside 0 to {n - 1} (the file has {n} tokens)"
        else:
            rank = int(fields[1])
            try:
                token = _strict_base64(fields[0])
            except binascii.Error as e:
                problem = f"has a token that is not base64 ({e})"
            else:
                if rank in line_of_rank:
                    problem = f"has rank {rank}, which line {line_of_rank[rank]} has too"
                elif token in line_of_token:
                    problem = f"has the token of line {line_of_token[token]} again"
                elif not token:
                    problem = "has an empty token"
        if problem is not None:
            shown = line[:60] + (b"..." if len(line) > 60 else b"")
            raise ValueError(
                f"{path} is not a tiktoken BPE file: line {number} ({shown!r}) {problem}; each line must be "
                f"'<base64 token> <rank>', with each token and each rank from 0 to n - 1 used once"
            )
        ranks[token] = rank
        line_of_token[token] = line_of_rank[rank] = number
    return ranks


class Tokenizer:
    """Llama 3's byte-level BPE (run by tiktoken) plus the special tokens of the chosen Llama version."""

    special_tokens: dict[str, int]

    num_reserved_special_tokens = 256

    pat_str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

    def __init__(self, model_path: str, *, version: str = "3", ranks: Optional[dict[bytes, int]] = None):
        """Loads the BPE ranks and sets up the special tokens.

        Args:
            model_path (str): The `tokenizer.model` shipped with the weights, as a local path or a blobfile
                URL (`gs://...`, `az://...`). It is read anew on every call, never from a cache.
            version (str): "3" for the Llama 3 special-token names, "3.1" for those of Llama 3.1 and
                later (same IDs, some renamed, plus `<|eom_id|>` as a stop token and the `ipython` role).
            ranks: The BPE ranks of `model_path`, where the caller has read them already (a GGUF checkpoint's
                vocabulary); None reads them from the file.

        Raises:
            ValueError: If `version` is not one of the supported versions, if `model_path` is not a path or is a
                folder, or if the file cannot be read or is not a tiktoken BPE file (see `load_bpe_ranks`).
            FileNotFoundError: If nothing exists at `model_path`.
        """
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"Unsupported tokenizer version {version!r}; use one of {SUPPORTED_VERSIONS}")
        if not isinstance(model_path, (str, os.PathLike)):
            raise ValueError(f"model_path must be the path of a tokenizer.model file, got {short_repr(model_path)}")
        model_path = os.fspath(model_path)
        try:
            exists, is_folder = files.exists(model_path), files.isdir(model_path)
        except (OSError, ValueError) as e:  # e.g. a path with a NUL character in it
            raise ValueError(f"Cannot read the tokenizer model file {model_path!r}: {e}") from e
        if not exists:
            raise FileNotFoundError(f"Tokenizer model file not found: {model_path}")
        if is_folder:
            raise ValueError(
                f"Tokenizer path {model_path} is a folder; pass the tokenizer.model file inside it "
                f"(e.g. {files.join(model_path, 'tokenizer.model')})"
            )
        self.version = version

        mergeable_ranks = load_bpe_ranks(model_path) if ranks is None else ranks
        self.num_base_tokens = len(mergeable_ranks)
        names = _special_token_names(version, self.num_reserved_special_tokens)
        self.special_tokens = {name: self.num_base_tokens + i for i, name in enumerate(names)}
        try:
            self.model = tiktoken.Encoding(
                name=Path(model_path).name,
                pat_str=self.pat_str,
                mergeable_ranks=mergeable_ranks,
                special_tokens=self.special_tokens,
            )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a panic of tiktoken's Rust core is a BaseException; the file is checked first
            raise ValueError(f"tiktoken cannot use the tokenizer model file {model_path}: {e!r}") from e

        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.eot_id: int = self.special_tokens["<|eot_id|>"]
        self.eom_id: int | None = self.special_tokens.get("<|eom_id|>")
        self.pad_id: int = -1
        self.stop_tokens = {self.eos_id, self.eot_id}
        if self.eom_id is not None:
            self.stop_tokens.add(self.eom_id)
        logger.info(
            f"Tokenizer {model_path} (Llama {version}): {self.n_words} tokens, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, stop tokens {sorted(self.stop_tokens)}"
        )

    def encode(
        self,
        s: str,
        *,
        bos: bool,
        eos: bool,
        allowed_special: Literal["all"] | AbstractSet[str] = set(),
        disallowed_special: Literal["all"] | Collection[str] = (),
    ) -> list[int]:
        """Turns text into token IDs, optionally framed by `bos_id` and `eos_id`.

        With the default `allowed_special` and `disallowed_special`, text that looks like a special token
        (for example "<|eot_id|>") is encoded as ordinary text, never as the control token.

        Args:
            s (str): Text to tokenize; any length.
            bos (bool): Put `<|begin_of_text|>` before the text's tokens.
            eos (bool): Put `<|end_of_text|>` after them.
            allowed_special ("all" or set of str): Special tokens that may appear as such in `s`.
            disallowed_special ("all" or collection of str): Special tokens whose text in `s` raises an
                error instead of being encoded as ordinary text.

        Returns:
            list[int]: `s`'s IDs, with the markers asked for around them.

        Raises:
            TypeError: If `s` is not a str.
        """
        if not isinstance(s, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(s).__name__}")

        # Long text goes to tiktoken in pieces of this many characters: its Rust core can panic
        # (pyo3_runtime.PanicException) when handed much more in one call.
        TIKTOKEN_MAX_ENCODE_CHARS = 400_000
        # Pieces are cut again inside any longer unbroken run of whitespace or of non-whitespace, which can
        # make tiktoken fail as well (https://github.com/openai/tiktoken/issues/195). No token spans a cut.
        MAX_NO_WHITESPACES_CHARS = 25_000

        substrs = (
            substr
            for i in range(0, len(s), TIKTOKEN_MAX_ENCODE_CHARS)
            for substr in self._split_whitespaces_or_nonwhitespaces(
                s[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
            )
        )
        t: list[int] = []
        for substr in substrs:
            t.extend(self.model.encode(substr, allowed_special=allowed_special, disallowed_special=disallowed_special))
        if bos:
            t.insert(0, self.bos_id)
        if eos:
            t.append(self.eos_id)
        return t

    def decode(self, t: Sequence[int]) -> str:
        """Turns token IDs back into text; special tokens come out as their names (e.g. "<|eot_id|>").

        Bytes that do not form valid UTF-8 (for example a token sequence cut inside a multi-byte
        character) become U+FFFD replacement characters.

        Args:
            t (Sequence[int]): IDs from `encode` or from the model.

        Returns:
            str: What the tokens spell.

        Raises:
            ValueError: If an entry of `t` is not an int (numpy integers are welcome, bools are not) in
                [0, `n_words`); the message names it.
        """
        return self.model.decode(token_id_list(t, self.n_words, where="Tokenizer.decode: "))

    def decode_bytes(self, t: Sequence[int]) -> bytes:
        """Like `decode`, but returns the tokens' bytes as they are, with no UTF-8 decoding.

        Useful when streaming: bytes of a character split across tokens can be held back until complete.

        Args:
            t (Sequence[int]): IDs from `encode` or from the model.

        Returns:
            bytes: Each token's bytes, one after the other.

        Raises:
            ValueError: As `decode`.
        """
        return self.model.decode_bytes(token_id_list(t, self.n_words, where="Tokenizer.decode_bytes: "))

    @staticmethod
    def _split_whitespaces_or_nonwhitespaces(s: str, max_consecutive_slice_len: int) -> Iterator[str]:
        """Cuts `s` into consecutive slices for tiktoken, none with a run longer than `max_consecutive_slice_len`.

        `s` is read as alternating runs of whitespace and of other characters (`str.isspace`; the regex `\\s`
        matches exactly those characters). A run longer than the limit is cut every
        `max_consecutive_slice_len` characters counted from the run's first character; nothing else is cut.
        The slices joined give `s` back; an empty `s` gives one empty slice.

        Raises:
            ValueError: If `max_consecutive_slice_len` is less than 1 (no slice could honour it).
        """
        step = max_consecutive_slice_len
        if step < 1:
            raise ValueError(f"max_consecutive_slice_len must be at least 1, got {step}")
        piece_start = 0
        for run in _RUNS.finditer(s):
            for cut in range(run.start() + step, run.end(), step):
                yield s[piece_start:cut]
                piece_start = cut
        yield s[piece_start:]
