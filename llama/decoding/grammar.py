"""Structured output: decoding under a grammar, so that an answer is valid JSON, or JSON that matches a schema,
whatever the model would rather write. docs/serve.md#structured-output says why llguidance does it here.

`Grammar.from_response_format` compiles OpenAI's `response_format` (or a tool's parameters) for the tokenizer, once
per request; `Grammar.start` gives a `Constraint` per answer. Before each draw, `Constraint.mask` sets the logits of
every token the grammar does not allow next to -inf; after it, `Constraint.advance` feeds the token drawn. Once the
grammar is complete only the stop tokens remain allowed. A call without a response format has no constraint and pays
nothing for this module.
"""

import functools
import importlib.util
import json
from typing import Any, Dict, List, Optional

import torch

INSTALL = "pip install 'llama3[serve]' (or pip install llguidance)"


class GrammarError(ValueError):
    """A response format or schema that cannot be compiled; the message names the part."""


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of `tokenizer` (a `llama.tokenizer.Tokenizer`): its BPE ranks, special tokens and split
    pattern, the stop tokens as end of text. Built once per tokenizer (about a second)."""
    from llguidance import LLTokenizer

    encoding = tokenizer.model
    return LLTokenizer.from_tiktoken(
        encoder=encoding._mergeable_ranks,
        special_tokens=encoding._special_tokens,
        pattern=encoding._pat_str,
        eos_token=sorted(tokenizer.stop_tokens),
        n_vocab=vocab_size,
    )


def json_schema_of(response_format: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The JSON schema an OpenAI `response_format` asks for: {"type": "json_object"} any object, {"type":
    "json_schema", "json_schema": {"schema": ...}} that schema, {"type": "text"} (or None) no constraint.

    Raises:
        GrammarError: for any other shape.
    """
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError('response_format.json_schema must be {"name": ..., "schema": {...}}')
        return spec.get("schema", {})
    raise GrammarError(f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


class Grammar:
    """A compiled grammar for one tokenizer and vocabulary size."""

    def __init__(self, compiled: str, llg_tokenizer, vocab_size: int):
        self.compiled, self.llg_tokenizer, self.vocab_size = compiled, llg_tokenizer, vocab_size

    @classmethod
    def from_json_schema(cls, schema: Dict[str, Any], tokenizer, vocab_size: int) -> "Grammar":
        """The grammar of JSON text that `schema` validates (separators as `json.dumps` writes them).

        Raises:
            GrammarError: where llguidance cannot compile the schema, with its reason (which names the part).
            ImportError: without llguidance, saying how to install it.
        """
        if importlib.util.find_spec("llguidance") is None:
            raise ImportError(f"Structured output needs llguidance: {INSTALL}")
        from llguidance import LLMatcher

        llg_tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        try:
            compiled = LLMatcher.grammar_from_json_schema(
                json.dumps(schema),
                defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
            )
        except ValueError as e:
            raise GrammarError(f"The JSON schema cannot be compiled: {e}") from None
        error = LLMatcher.validate_grammar(compiled, llg_tokenizer)
        if error:
            raise GrammarError(f"The JSON schema cannot be compiled: {error}")
        return cls(compiled, llg_tokenizer, vocab_size)

    @classmethod
    def from_response_format(cls, response_format, tokenizer, vocab_size: int) -> Optional["Grammar"]:
        """The grammar of an OpenAI `response_format` (a dict), or None for plain text."""
        schema = json_schema_of(response_format)
        return None if schema is None else cls.from_json_schema(schema, tokenizer, vocab_size)

    def start(self) -> "Constraint":
        from llguidance import LLMatcher

        return Constraint(LLMatcher(self.llg_tokenizer, self.compiled), self.vocab_size)


class Constraint:
    """One answer's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # bit t of word t // 32: token t
        self.bits = torch.arange(32, dtype=torch.int32)

    def allowed_tokens(self) -> torch.Tensor:
        """(vocab_size,) bool: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)
        return ((self.bitmask[:, None] >> self.bits) & 1).view(-1)[: self.vocab_size].bool()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (vocab_size,) with every token the grammar does not allow next at -inf."""
        return logits.masked_fill(~self.allowed_tokens().to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        """Feed the token drawn (a stop token ends the answer and needs no feeding)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)


def constraints_for(
    response_format: Optional[dict], tokenizer, vocab_size: int, rows: int
) -> Optional[List[Optional[Constraint]]]:
    """A grammar's constraint per row for an OpenAI-style `response_format`, or None for free text."""
    if response_format is None:
        return None
    grammar = Grammar.from_response_format(response_format, tokenizer, vocab_size)
    return None if grammar is None else [grammar.start() for _ in range(rows)]
