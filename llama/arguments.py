"""What a caller passes in: the sampling defaults, the checks of every argument, with errors that name the
argument and the fix (`ValueError`), and `short_repr`, which keeps any value the checks quote short. Nothing here
imports torch, so that the `llama` command can check its flags (and answer `--version`) before torch loads."""

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Optional

# The sampling defaults of Meta's `text_completion` and `chat_completion`, used wherever a caller may leave them out.
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.9
DEFAULT_DRAFT_MAX = 8  # the most guessed tokens speculative decoding checks in one pass
LOOKUP = "lookup"  # `Llama.build(draft=...)`'s name for prompt lookup; any other draft is a checkpoint folder


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


def check_sampling(temperature: float, top_p: float, max_gen_len: Optional[int]) -> None:
    """Raise a ValueError naming the sampling argument that cannot work (max_gen_len None: as long as fits).

    temperature and top_p are real numbers (a float, an int, a numpy float; not a bool), temperature finite and
    >= 0, top_p in (0, 1]; max_gen_len is as `checked_gen_len` takes it.
    """
    value = as_float(temperature)
    if value is None or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {short_repr(temperature)}")
    value = as_float(top_p)
    if value is None or not 0 < value <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {short_repr(top_p)}")
    checked_gen_len(max_gen_len)


def checked_gen_len(max_gen_len: Optional[int]) -> Optional[int]:
    """`max_gen_len` as a Python int (None stays None), or a ValueError unless it is an int >= 0 (numpy integers
    too; not a bool)."""
    if max_gen_len is None:
        return None
    if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, numbers.Integral) or max_gen_len < 0:
        raise ValueError(f"max_gen_len must be a non-negative integer or None, got {short_repr(max_gen_len)}")
    return int(max_gen_len)


def as_float(value) -> Optional[float]:
    """`value` as a float when it is a real number (not a bool) that a float can hold, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError):  # e.g. 10**400
        return None
