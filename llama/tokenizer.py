import binascii
import re
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from logging import getLogger
from pathlib import Path
from typing import Literal, TypedDict

import blobfile
import tiktoken

logger = getLogger(__name__)

Role = Literal["system", "user", "assistant", "ipython"]


class Message(TypedDict):
    role: Role
    content: str


Dialog = Sequence[Message]

SUPPORTED_VERSIONS = ("3", "3.1")
# Maximal runs of whitespace, or of anything else; see Tokenizer._split_whitespaces_or_nonwhitespaces.
_RUNS = re.compile(r"\s+|\S+")
# Chat roles each version accepts; "ipython" (tool output) arrived with Llama 3.1.
_ROLES = {"3": ("system", "user", "assistant"), "3.1": ("system", "user", "assistant", "ipython")}


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
    """The BPE merge ranks of a tiktoken model file: one `<base64 token> <rank>` per line.

    What `tiktoken.load.load_tiktoken_bpe` returns, read from `path` itself: tiktoken keeps a copy of every
    file it loads in the temp folder, keyed by its path, and reads that copy thereafter, so a file replaced in
    place would be ignored. Parsed as one split rather than line by line, which is about 2x faster.

    The bytes come through `blobfile`, so `path` may be local or a blobfile URL (`gs://...`, `az://...`).

    Raises:
        FileNotFoundError: If nothing exists at `path`.
        ValueError: If the file is not in the format above.
    """
    data = blobfile.read_bytes(path)
    fields, lines = data.split(), data.splitlines()
    try:
        if len(fields) != 2 * (len(lines) - lines.count(b"")):
            raise ValueError("a line does not have exactly two fields")
        return dict(zip(map(binascii.a2b_base64, fields[0::2]), map(int, fields[1::2])))
    except ValueError as e:  # binascii.Error is one too
        raise ValueError(
            f"{path} is not a tiktoken BPE file ({e}); each line must be '<base64 token> <rank>'"
        ) from None


class Tokenizer:
    """Llama 3's byte-level BPE (run by tiktoken) plus the special tokens of the chosen Llama version."""

    special_tokens: dict[str, int]

    num_reserved_special_tokens = 256

    pat_str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

    def __init__(self, model_path: str, *, version: str = "3"):
        """Loads the BPE ranks and sets up the special tokens.

        Args:
            model_path (str): The `tokenizer.model` shipped with the weights, as a local path or a blobfile
                URL (`gs://...`, `az://...`). It is read anew on every call, never from a cache.
            version (str): "3" for the Llama 3 special-token names, "3.1" for those of Llama 3.1 and
                later (same IDs, some renamed, plus `<|eom_id|>` as a stop token and the `ipython` role).

        Raises:
            ValueError: If `version` is not one of the supported versions, if `model_path` is a folder, or
                if the file is not a tiktoken BPE file.
            FileNotFoundError: If nothing exists at `model_path`.
        """
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"Unsupported tokenizer version {version!r}; use one of {SUPPORTED_VERSIONS}")
        if not blobfile.exists(model_path):
            raise FileNotFoundError(f"Tokenizer model file not found: {model_path}")
        if blobfile.isdir(model_path):
            raise ValueError(
                f"Tokenizer path {model_path} is a folder; pass the tokenizer.model file inside it "
                f"(e.g. {blobfile.join(model_path, 'tokenizer.model')})"
            )
        self.version = version

        mergeable_ranks = load_bpe_ranks(model_path)
        self.num_base_tokens = len(mergeable_ranks)
        names = _special_token_names(version, self.num_reserved_special_tokens)
        self.special_tokens = {name: self.num_base_tokens + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding(
            name=Path(model_path).name,
            pat_str=self.pat_str,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )

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
            t.extend(
                self.model.encode(substr, allowed_special=allowed_special, disallowed_special=disallowed_special)
            )
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
        """
        return self.model.decode(list(t))

    def decode_bytes(self, t: Sequence[int]) -> bytes:
        """Like `decode`, but returns the tokens' bytes as they are, with no UTF-8 decoding.

        Useful when streaming: bytes of a character split across tokens can be held back until complete.

        Args:
            t (Sequence[int]): IDs from `encode` or from the model.

        Returns:
            bytes: Each token's bytes, one after the other.
        """
        return self.model.decode_bytes(list(t))

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


class ChatFormat:
    """Encodes messages and dialogs in the Llama 3 chat format."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def encode_header(self, message: Message) -> list[int]:
        """Encodes `<|start_header_id|>` role `<|end_header_id|>` and the blank line after it.

        Args:
            message (Message): The message whose role to encode; its content is ignored.

        Returns:
            list[int]: The header's token IDs.

        Raises:
            ValueError: If the role is not allowed for this tokenizer's version.
        """
        role = message["role"]
        allowed = _ROLES[self.tokenizer.version]
        if role not in allowed:
            hint = ' (the "ipython" role needs a Tokenizer with version="3.1")' if role == "ipython" else ""
            raise ValueError(f"Unknown message role {role!r}; allowed roles are {list(allowed)}{hint}")
        tokens = [self.tokenizer.special_tokens["<|start_header_id|>"]]
        tokens.extend(self.tokenizer.encode(role, bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|end_header_id|>"])
        tokens.extend(self.tokenizer.encode("\n\n", bos=False, eos=False))
        return tokens

    def encode_message(self, message: Message) -> list[int]:
        """Encodes a message: its header, its content stripped of surrounding whitespace, then `<|eot_id|>`.

        Args:
            message (Message): The message to encode.

        Returns:
            list[int]: The message's token IDs.

        Raises:
            ValueError: If the message has no role or content, the role is not allowed, or the content is not a
                str.
        """
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            shown = repr(message) if len(repr(message)) <= 200 else repr(message)[:200] + "..."
            raise ValueError(f"A message must be a dict with a 'role' and a 'content'; got {shown}")
        tokens = self.encode_header(message)
        content = message["content"]
        if not isinstance(content, str):
            # ValueError, like every other malformed-message error, so callers catch one type.
            raise ValueError(f"Message content must be a str, got {type(content).__name__}")  # noqa: TRY004
        tokens.extend(self.tokenizer.encode(content.strip(), bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|eot_id|>"])
        return tokens

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        """Encodes a dialog as a prompt: `<|begin_of_text|>`, every message, then an assistant header with
        no content after it, so that what the model generates next is the assistant's reply.

        Args:
            dialog (Dialog): The messages, in order.

        Returns:
            list[int]: The prompt's token IDs.

        Raises:
            ValueError: If a message has a role that is not allowed or content that is not a str.
        """
        tokens = [self.tokenizer.special_tokens["<|begin_of_text|>"]]
        for message in dialog:
            tokens.extend(self.encode_message(message))
        tokens.extend(self.encode_header({"role": "assistant", "content": ""}))
        return tokens
