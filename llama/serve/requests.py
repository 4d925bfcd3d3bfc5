"""What the engine (`llama.serve.engine`) takes and gives: a `Request` to continue a prompt, the `Output`s it is
handed from the engine's thread, and `QueueFull` where no request may wait."""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from llama.decoding.grammar import Constraint
from llama.vision.batch import ImageTiles


@dataclass
class Output:
    """What a request gets from the engine thread: a token, or, last, why it finished."""

    token: Optional[int] = None
    logprob: Optional[float] = None  # the token's log-probability under the model's logits (no temperature)
    top_logprobs: Optional[List[Tuple[int, float]]] = None  # the most likely tokens and theirs, when asked for
    # Before the first token, for a request that scores its prompt: each prompt token's (logprob, top_logprobs),
    # None for the first (nothing predicts it).
    prompt_logprobs: Optional[List[Optional[Tuple[float, List[Tuple[int, float]]]]]] = None
    finish: Optional[str] = None  # "end_of_turn", "end_of_message", "length"; "error", "cancelled" (shutdown)
    cached_tokens: int = 0  # of a token or a stop: the request's prompt tokens reused from the KV cache


@dataclass
class Request:
    """One prompt to continue. `emit` is called from the engine's thread with each `Output`, in order."""

    prompt: List[int]
    max_tokens: int
    temperature: float
    top_p: float
    emit: Callable[[Output], None]
    seed: Optional[int] = None  # None: draws from a generator seeded at random
    top_logprobs: Optional[int] = None  # None: no logprobs; k: each token's logprob and the k likeliest
    score_prompt: bool = False  # also each prompt token's logprob (and top_logprobs' likeliest): the whole prompt runs
    constraint: Optional[Constraint] = None  # a grammar the answer must follow (`llama.decoding.grammar`)
    # A vision model's prompt: its images, one per <|image|> in order, as `llama.vision.batch.image_input` makes them.
    images: List[ImageTiles] = field(default_factory=list)
    cancelled: bool = False
    cached_tokens: int = 0  # set by the engine: prompt tokens whose keys and values it reused rather than computed


class QueueFull(Exception):
    """Every row is busy and the waiting queue is full."""
