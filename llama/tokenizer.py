import ast
import binascii
import functools
import json
import numbers
import os
import re
import uuid
import warnings
from collections.abc import Collection, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from logging import getLogger
from pathlib import Path
from typing import Any, Literal, Optional, TypedDict

import blobfile
import tiktoken

logger = getLogger(__name__)

# "tool" is another name for "ipython" (a tool's output): both are written as ipython, as llama-models does.
Role = Literal["system", "user", "assistant", "ipython", "tool"]
# Why an answer ended: <|eot_id|>, <|eom_id|> (Llama 3.1+: a tool call awaits its result), or max_gen_len.
StopReason = Literal["end_of_turn", "end_of_message", "length"]
STOP_REASONS = ("end_of_turn", "end_of_message", "length")


class _ToolCallFields(TypedDict):
    tool_name: str  # a built-in tool (BUILTIN_TOOLS) or a function's name
    arguments: dict[str, Any]


class ToolCall(_ToolCallFields, total=False):
    """A tool call made by the assistant (Llama 3.1 and later)."""

    call_id: str  # set on calls read from the model's output; never written into the prompt


class _MessageFields(TypedDict):
    role: Role
    content: str


class Message(_MessageFields, total=False):
    """A chat message. Assistant messages of Llama 3.1 and later may also carry tool calls."""

    tool_calls: list[ToolCall]  # written after the content, each call in the chat format
    stop_reason: StopReason  # "end_of_message" ends the message with <|eom_id|> instead of <|eot_id|>


Dialog = Sequence[Message]

SUPPORTED_VERSIONS = ("3", "3.1")
# Maximal runs of whitespace, or of anything else; see Tokenizer._split_whitespaces_or_nonwhitespaces.
_RUNS = re.compile(r"\s+|\S+")
# Chat roles each version accepts; "ipython" (tool output, alias "tool") arrived with Llama 3.1.
_ROLES = {"3": ("system", "user", "assistant"), "3.1": ("system", "user", "assistant", "ipython", "tool")}

# The tools Llama 3.1+ was trained to call by name. The first three are called as `name.call(query="...")`, the
# code interpreter by writing Python code after <|python_tag|>.
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")
_QUERY_TOOLS = ("brave_search", "wolfram_alpha", "photogen")
# How calls to custom tools (functions) are written back into a prompt; llama-models' default is "json".
TOOL_PROMPT_FORMATS = ("json", "function_tag", "python_list")


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
    each used once, and a token for each of the 256 bytes (byte-level BPE starts from single bytes).

    What `tiktoken.load.load_tiktoken_bpe` returns for a sound file, read from `path` itself: tiktoken keeps a copy
    of every file it loads in the temp folder, keyed by its path, and reads that copy thereafter, so a file replaced
    in place would be ignored. Checked here, because tiktoken trusts the file: a rank used twice makes its Rust core
    panic (a BaseException), a rank gap or a token listed twice gives an ordinary token the ID of a special one.

    The bytes come through `blobfile`, so `path` may be local or a blobfile URL (`gs://...`, `az://...`).

    Raises:
        FileNotFoundError: If nothing exists at `path`.
        ValueError: If the file cannot be read or is not as above; the message names the first bad line.
    """
    try:
        data = blobfile.read_bytes(path)
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

    About 2x faster than reading line by line: each check runs over the whole file at once.
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


def token_id_list(ids: Sequence[int], vocab_size: int, where: str = "") -> list[int]:
    """`ids` as a list of Python ints, each a token ID of a vocabulary of `vocab_size`: an int or a numpy integer
    (any `numbers.Integral`), not a bool, in [0, `vocab_size`).

    Raises:
        ValueError: If `ids` is not a sequence, or for its first entry that is not a token ID; the message starts
            with `where` (e.g. "Prompt 2: ") and names the entry and its position.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{where}token IDs must be a sequence of ints, got {short_repr(ids)}")
    ids = list(ids)
    if set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return ids  # the usual case, checked at C speed
    for position, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ValueError(f"{where}token ID {short_repr(x)} at position {position} is not an int")
        if not 0 <= x < vocab_size:
            raise ValueError(
                f"{where}token ID {short_repr(x)} at position {position} is outside the vocabulary [0, {vocab_size})"
            )
    return [int(x) for x in ids]


def short_repr(value: Any, limit: int = 200) -> str:
    """`repr(value)` for an error message, cut after `limit` characters; where repr fails (an int too long to
    write, a list nested too deeply), what it is instead."""
    try:
        text = repr(value)
    except Exception:
        return f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


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
            exists, is_folder = blobfile.exists(model_path), blobfile.isdir(model_path)
        except (OSError, ValueError) as e:  # e.g. a path with a NUL character in it
            raise ValueError(f"Cannot read the tokenizer model file {model_path!r}: {e}") from e
        if not exists:
            raise FileNotFoundError(f"Tokenizer model file not found: {model_path}")
        if is_folder:
            raise ValueError(
                f"Tokenizer path {model_path} is a folder; pass the tokenizer.model file inside it "
                f"(e.g. {blobfile.join(model_path, 'tokenizer.model')})"
            )
        self.version = version

        mergeable_ranks = load_bpe_ranks(model_path)
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


class ChatFormat:
    """Writes messages and dialogs in the Llama 3 chat format, tool calls included (Llama 3.1 and later), and reads
    an assistant's answer back into a message with its tool calls."""

    def __init__(self, tokenizer: Tokenizer, *, tool_prompt_format: str = "json", strip_content: bool = True):
        """Sets up the format for `tokenizer`'s special tokens and chat roles.

        Args:
            tokenizer (Tokenizer): The tokenizer; its version decides the roles and tokens available.
            tool_prompt_format (str): How calls to custom tools in assistant messages are written: "json" (the
                default, as llama-models writes them), "function_tag" or "python_list". Built-in tools are
                always written in their own format.
            strip_content (bool): Strip whitespace around each message's content, as Meta's Llama 3 reference
                does (the default, and what `Llama` uses). False keeps content as given, as llama-models does;
                the two agree on content with no whitespace at either end.

        Raises:
            ValueError: If `tool_prompt_format` is not one of `TOOL_PROMPT_FORMATS`.
        """
        if tool_prompt_format not in TOOL_PROMPT_FORMATS:
            raise ValueError(
                f"Unknown tool_prompt_format {short_repr(tool_prompt_format)}; use one of {TOOL_PROMPT_FORMATS}"
            )
        self.tokenizer = tokenizer
        self.tool_prompt_format = tool_prompt_format
        self.strip_content = strip_content

    def encode_header(self, message: Message) -> list[int]:
        """Encodes `<|start_header_id|>` role `<|end_header_id|>` and the blank line after it.

        The "tool" role is written as "ipython", the role Llama 3.1 was trained with.

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
            needs_31 = role in _ROLES["3.1"]
            hint = f' (the "{role}" role needs a Tokenizer with version="3.1")' if needs_31 else ""
            raise ValueError(f"Unknown message role {short_repr(role)}; allowed roles are {list(allowed)}{hint}")
        tokens = [self.tokenizer.special_tokens["<|start_header_id|>"]]
        tokens.extend(self.tokenizer.encode("ipython" if role == "tool" else role, bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|end_header_id|>"])
        tokens.extend(self.tokenizer.encode("\n\n", bos=False, eos=False))
        return tokens

    def encode_message(self, message: Message) -> list[int]:
        """Encodes a message: its header, its content stripped of surrounding whitespace (unless `strip_content` is
        False), then `<|eot_id|>`.

        An assistant message may carry `tool_calls` (Llama 3.1+). Each call is written after the content and
        tokenized on its own, as llama-models does: built-in search tools as `name.call(query="...")`, the code
        interpreter as its code after a leading `<|python_tag|>`, custom tools in `tool_prompt_format`. With
        `"stop_reason": "end_of_message"` the message ends with `<|eom_id|>` instead of `<|eot_id|>`.

        Args:
            message (Message): The message to encode.

        Returns:
            list[int]: The message's token IDs.

        Raises:
            ValueError: If the message has no role or content, the role is not allowed, the content is not a str,
                or its tool calls or stop reason are malformed or need Llama 3.1 tokens.
        """
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"A message must be a dict with a 'role' and a 'content'; got {short_repr(message)}")
        tokens = self.encode_header(message)
        content = message["content"]
        if not isinstance(content, str):
            # ValueError, like every other malformed-message error, so callers catch one type.
            raise ValueError(f"Message content must be a str, got {type(content).__name__}")  # noqa: TRY004
        tool_calls, end_of_message = _check_assistant_fields(message, self.tokenizer.version)
        if tool_calls and tool_calls[0]["tool_name"] == "code_interpreter":
            tokens.append(self.tokenizer.special_tokens["<|python_tag|>"])
        tokens.extend(self.tokenizer.encode(content.strip() if self.strip_content else content, bos=False, eos=False))
        for call in tool_calls:
            tokens.extend(self.tokenizer.encode(encode_tool_call(call, self.tool_prompt_format), bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|eom_id|>" if end_of_message else "<|eot_id|>"])
        return tokens

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        """Encodes a dialog as a prompt: `<|begin_of_text|>`, every message, then an assistant header with
        no content after it, so that what the model generates next is the assistant's reply.

        Args:
            dialog (Dialog): The messages, in order.

        Returns:
            list[int]: The prompt's token IDs.

        Raises:
            ValueError: If `dialog` is not a list of messages, or a message cannot be encoded (see
                `encode_message`).
        """
        if isinstance(dialog, dict):
            raise ValueError("A dialog is a list of messages; wrap a single message in a list")
        if isinstance(dialog, (str, bytes)) or not isinstance(dialog, Iterable):
            raise ValueError(f"A dialog must be a list of messages, got {type(dialog).__name__}")
        tokens = [self.tokenizer.special_tokens["<|begin_of_text|>"]]
        for message in dialog:
            tokens.extend(self.encode_message(message))
        tokens.extend(self.encode_header({"role": "assistant", "content": ""}))
        return tokens

    def decode_assistant_message(self, tokens: Sequence[int], stop_reason: StopReason) -> Message:
        """Reads generated tokens back into an assistant message, with the tool calls they make.

        See `decode_assistant_message_from_content`, which this calls on the tokens' text.

        Args:
            tokens (Sequence[int]): The answer's token IDs, with or without its final stop token.
            stop_reason (StopReason): Why generation stopped; a final `<|eot_id|>` or `<|eom_id|>` overrides it.

        Returns:
            Message: {"role": "assistant", "content", "stop_reason", "tool_calls"}.

        Raises:
            ValueError: If `stop_reason` is not one of `STOP_REASONS`.
        """
        return self.decode_assistant_message_from_content(self.tokenizer.decode(tokens), stop_reason)

    def decode_assistant_message_from_content(self, content: str, stop_reason: StopReason) -> Message:
        """Reads an answer's text into an assistant message, finding tool calls as llama-models does.

        Spaces around the text, a leading assistant header and a leading `<|python_tag|>` are removed, and a
        final `<|eot_id|>` or `<|eom_id|>` sets the stop reason. Then the first of these that matches is the
        call: `<function=name>{json}</function>`; the whole text as a JSON object with "name" and "parameters";
        the whole text as a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]` (every call is
        returned); `name.call(query="...")` anywhere in the text; and, after `<|python_tag|>`, the text as code
        for the code interpreter. A custom-tool form whose name is a built-in tool becomes that tool's call with
        {"query": first argument}. When a call is found the content is empty. Nothing is ever run, and text
        that is not a well-formed call stays content: this never raises on the text.

        Args:
            content (str): The answer as text, as `Tokenizer.decode` gives it.
            stop_reason (StopReason): Why generation stopped; a final `<|eot_id|>` or `<|eom_id|>` overrides it.

        Returns:
            Message: {"role": "assistant", "content", "stop_reason", "tool_calls"}; "tool_calls" may be empty.
                Each call has a fresh "call_id".

        Raises:
            ValueError: If `stop_reason` is not one of `STOP_REASONS` or `content` is not a str.
        """
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}, got {short_repr(stop_reason)}")
        if not isinstance(content, str):
            raise ValueError(f"content must be a str, got {type(content).__name__}")  # noqa: TRY004
        content = content.strip(" ")
        if content.startswith(_ASSISTANT_HEADER):
            content = content[len(_ASSISTANT_HEADER) :]
        python_tag = content.startswith("<|python_tag|>")
        if python_tag:
            content = content[len("<|python_tag|>") :]
        for end, reason in (("<|eot_id|>", "end_of_turn"), ("<|eom_id|>", "end_of_message")):
            if content.endswith(end):
                content, stop_reason = content[: -len(end)], reason
                break
        tool_calls = parse_tool_calls(content, python_tag=python_tag)
        return {
            "role": "assistant",
            "content": "" if tool_calls else content,
            "stop_reason": stop_reason,
            "tool_calls": tool_calls,
        }


def check_tool_call(call: ToolCall) -> None:
    """Raises a ValueError that says what is wrong with a tool call given in a message, if anything.

    A call is a dict with "tool_name" (a non-empty str) and "arguments" (a dict), and optionally "call_id". The
    built-in search tools need a "query" argument, the code interpreter a "code" argument that is a str.
    """
    if not isinstance(call, dict):
        raise ValueError(f"A tool call must be a dict with 'tool_name' and 'arguments', got {short_repr(call)}")
    name = call.get("tool_name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"A tool call needs a 'tool_name' that is a non-empty str; got {short_repr(call)}")
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        raise ValueError(f"The call to {name!r} needs 'arguments' that is a dict, got {short_repr(arguments)}")
    if name in _QUERY_TOOLS and "query" not in arguments:
        raise ValueError(
            f"The call to the built-in tool {name!r} needs a 'query' argument, got {short_repr(arguments)}"
        )
    if name == "code_interpreter" and not isinstance(arguments.get("code"), str):
        raise ValueError(f"The call to 'code_interpreter' needs a 'code' argument (a str), got {short_repr(arguments)}")


def encode_tool_call(call: ToolCall, tool_prompt_format: str = "json") -> str:
    """The text of a tool call as an assistant message holds it (llama-models' forms).

    `brave_search`, `wolfram_alpha` and `photogen`: `name.call(query="...")`. `code_interpreter`: the code itself
    (the message puts `<|python_tag|>` before its content). Any other tool, by `tool_prompt_format`:
    "json": `{"type": "function", "name": ..., "parameters": ...}` as `json.dumps` writes it with its defaults;
    "function_tag": `<function=name>{json arguments}</function>`; "python_list": `[name(a="x", b=2)]`.

    Args:
        call (ToolCall): The call.
        tool_prompt_format (str): One of `TOOL_PROMPT_FORMATS`.

    Returns:
        str: The call's text, to be tokenized on its own.

    Raises:
        ValueError: If the call is malformed (see `check_tool_call`), its arguments cannot be written in the
            format, or the format is unknown.
    """
    check_tool_call(call)
    name, arguments = call["tool_name"], call["arguments"]
    if name in _QUERY_TOOLS:
        return f'{name}.call(query="{arguments["query"]}")'
    if name == "code_interpreter":
        return arguments["code"]
    try:
        if tool_prompt_format == "json":
            return json.dumps({"type": "function", "name": name, "parameters": arguments})
        if tool_prompt_format == "function_tag":
            return f"<function={name}>{json.dumps(arguments)}</function>"
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"The arguments of the call to {name!r} cannot be written as JSON: {e}") from None
    if tool_prompt_format == "python_list":
        try:
            return f"[{name}({', '.join(f'{key}={_python_value(value)}' for key, value in arguments.items())})]"
        except RecursionError:
            raise ValueError(
                f"The arguments of the call to {name!r} are nested too deeply, or hold themselves"
            ) from None
    raise ValueError(f"Unknown tool_prompt_format {short_repr(tool_prompt_format)}; use one of {TOOL_PROMPT_FORMATS}")


def parse_tool_calls(text: str, python_tag: bool = False) -> list[ToolCall]:
    """The tool calls in an answer's text, by the rules of `ChatFormat.decode_assistant_message_from_content`.

    Args:
        text (str): The answer, without its leading `<|python_tag|>` and final stop token.
        python_tag (bool): Whether the answer began with `<|python_tag|>`: then text that is no other call is
            code for the code interpreter.

    Returns:
        list[ToolCall]: The calls found, each with a fresh "call_id"; empty if there are none.
    """
    found = _custom_tool_calls(text)
    if found is None:
        match = _BUILTIN_CALL.search(text)
        if match:
            found = [(match["tool_name"], {"query": match["query"]})]
        elif python_tag:
            found = [("code_interpreter", {"code": text})]
        else:
            found = []
    return [{"call_id": str(uuid.uuid4()), "tool_name": name, "arguments": arguments} for name, arguments in found]


_ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
# A built-in search tool's call; any word before ".call" is taken as the tool's name. Linear in the text: `\b\w+`
# starts only at a word's first character, and `[^"]*` gives up at the first quote.
_BUILTIN_CALL = re.compile(r'\b(?P<tool_name>\w+)\.call\(query="(?P<query>[^"]*)"\)')
_Calls = Optional[list[tuple[str, dict]]]


def _check_assistant_fields(message: Message, version: str) -> tuple[list[ToolCall], bool]:
    """A message's tool calls (checked) and whether it ends with <|eom_id|>; only assistant messages have them."""
    tool_calls = message.get("tool_calls") or []
    stop_reason = message.get("stop_reason")
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"'tool_calls' must be a list of tool calls, got {type(tool_calls).__name__}")
    if message["role"] != "assistant" and (tool_calls or stop_reason is not None):
        raise ValueError(
            f"Only assistant messages carry 'tool_calls' or 'stop_reason'; this message's role is {message['role']!r}"
        )
    if stop_reason is not None and stop_reason not in STOP_REASONS:
        raise ValueError(f"'stop_reason' must be one of {STOP_REASONS}, got {short_repr(stop_reason)}")
    if version == "3" and (tool_calls or stop_reason == "end_of_message"):
        raise ValueError(
            'Tool calls and "stop_reason": "end_of_message" (<|eom_id|>) need a Tokenizer with version="3.1" '
            "(Llama 3.1 and later)"
        )
    for call in tool_calls:
        check_tool_call(call)
    return list(tool_calls), stop_reason == "end_of_message"


def _python_value(value: Any) -> str:
    """A call argument as the "python_list" format writes it (llama-models' rules: strings in double quotes as they
    are, dicts as {key=value})."""
    if isinstance(value, str):
        return f'"{value}"'
    if value is None or isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_python_value(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_python_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"A tool call argument of type {type(value).__name__} cannot be written as a Python value")


def _custom_tool_calls(text: str) -> _Calls:
    """Calls in one of the custom-tool forms (function tag, JSON object, Python list), or None."""
    tag = _function_tag(text)
    if tag:
        name, args_start, args_end = tag
        arguments = _tag_arguments(text, args_start, args_end)
        calls = None if arguments is None else [(name, arguments)]
    elif (obj := _json_object(text)) is not None:
        calls = None
        if obj.get("type") == "function" or "name" in obj:
            name, parameters = obj.get("name"), obj.get("parameters")
            if isinstance(name, str) and name and isinstance(parameters, dict):
                calls = [(name, parameters)]
    else:
        calls = _python_list_calls(text)
    if calls is None:
        return None
    calls = [_builtin_as_called(name, arguments) for name, arguments in calls]
    return None if None in calls else calls


def _builtin_as_called(name: str, arguments: dict) -> Optional[tuple[str, dict]]:
    """A built-in tool called in a custom-tool form takes its first argument as the query (None: it has none)."""
    if name not in BUILTIN_TOOLS:
        return name, arguments
    return (name, {"query": next(iter(arguments.values()))}) if arguments else None


def _function_tag(text: str) -> Optional[tuple[str, int, int]]:
    """The first `<function=name>{...}` in `text`: the name, and where its arguments start ("{") and end (after the
    first "}"); None if there is none.

    What llama-models' pattern `<function=([^}]+)>({.*?})` finds, read in one pass instead of by a backtracking
    regex (which takes minutes on a few kB of repeated `<function=x>{`). For a `<function=` the name runs to the
    first "}" after it at most, so the arguments end at that "}"; the greedy name makes them start at the last ">{"
    before it, and they may not hold a line break (`.` does not match one). When that fails, every later
    `<function=` before the same "}" fails too, so the search goes on after it.
    """
    prefix = "<function="
    start = text.find(prefix)
    while start >= 0:
        name_start = start + len(prefix)
        close = text.find("}", name_start)
        if close < 0:
            return None
        opening = text.rfind(">{", name_start + 1, close)  # the name has at least one character
        if opening >= 0 and text.find("\n", opening + 2, close) < 0:
            return text[name_start:opening], opening + 1, close + 1
        start = text.find(prefix, close + 1)
    return None


def _tag_arguments(text: str, args_start: int, args_end: int) -> Optional[dict]:
    """The JSON object at `text[args_start:args_end]`, after `<function=name>`: as it is, else read in full from its
    "{" (it ends at the first "}", inside any nested object), else with single quotes read as double ones."""
    args = text[args_start:args_end]
    attempts = (
        lambda: json.loads(args),
        lambda: json.JSONDecoder().raw_decode(text, args_start)[0],
        lambda: json.loads(args.replace("'", '"')),
    )
    for attempt in attempts:
        try:
            value = attempt()
        except (ValueError, RecursionError):
            continue
        return value if isinstance(value, dict) else None
    return None


def _json_object(text: str) -> Optional[dict]:
    """`text` read as one JSON object, or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _python_list_calls(text: str) -> _Calls:
    """The calls of `text` read as a Python list of calls with keyword arguments of literal values, or None.

    Nothing is evaluated: the text is parsed, and only literals (strings, numbers, booleans, None, and lists and
    dicts of them) are read.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for an invalid escape in a string
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    expr = tree.body[0].value
    if not isinstance(expr, ast.List) or not expr.elts:
        return None
    calls = []
    for call in expr.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        arguments = {}
        for keyword in call.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _plain(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append((call.func.id, arguments))
    return calls


def _plain(value: Any) -> Any:
    """`value` as JSON data (tuples become lists); a ValueError for anything else (sets, bytes, complex numbers)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    raise ValueError(f"not JSON data: {type(value).__name__}")
