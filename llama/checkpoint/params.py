"""params.json and config.json as read: each field of a known kind and within bounds, the file a plain JSON
object, and ModelArgs made from it."""

import itertools
import json
import numbers
import re
from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from llama.arguments import short_repr
from llama.model import ModelArgs
from llama.quantize import INT4_GROUP_SIZES, SCHEMES
from llama.tokenizer import files
from llama.vision.model import ENCODER_FIELDS, VISION_FIELDS

HF_CONFIG = "config.json"
META_PARAMS = "params.json"
GENERATION_CONFIG = "generation_config.json"  # Hugging Face's sampling defaults for a checkpoint

# The kind of value each configuration field holds ("int", "number", "bool"), whether it may be null, and for a
# number the largest value allowed; every number must be positive, and finite. Checked when the file is read, so
# that a bad value is named there, not deep in torch. The bounds lie far above any Llama (the largest, 405B: dim
# 16384, 126 layers, 128 heads, FFN width 53248, vocabulary 128256, rope_theta 500000) and low enough that every
# size computed from them stays exact in int64 and float32.
MAX_WIDTH = 2**20  # dim, and a head's width
MAX_LAYERS = 2**12
MAX_HEADS = 2**16
MAX_VOCAB = 2**24
MAX_FFN_WIDTH = 2**24
MAX_ROPE_THETA = 1e12
MAX_ROPE_SCALING_FACTOR = 2**10
MAX_FFN_DIM_MULTIPLIER = 2**8
MAX_NORM_EPS = 1.0
PARAMS_FIELDS = {
    "dim": ("int", False, MAX_WIDTH),
    "n_layers": ("int", False, MAX_LAYERS),
    "n_heads": ("int", False, MAX_HEADS),
    "n_kv_heads": ("int", True, MAX_HEADS),
    "vocab_size": ("int", False, MAX_VOCAB),
    "multiple_of": ("int", False, MAX_FFN_WIDTH),
    "ffn_dim_multiplier": ("number", True, MAX_FFN_DIM_MULTIPLIER),
    "norm_eps": ("number", False, MAX_NORM_EPS),
    "rope_theta": ("number", False, MAX_ROPE_THETA),
    "use_scaled_rope": ("bool", False, None),
    "rope_scaling_factor": ("number", True, MAX_ROPE_SCALING_FACTOR),
    "tie_word_embeddings": ("bool", True, None),
}
PARAMS_REQUIRED = ("dim", "n_layers", "n_heads", "vocab_size")
HF_CONFIG_FIELDS = {
    "hidden_size": ("int", False, MAX_WIDTH),
    "num_hidden_layers": ("int", False, MAX_LAYERS),
    "num_attention_heads": ("int", False, MAX_HEADS),
    "num_key_value_heads": ("int", True, MAX_HEADS),
    "head_dim": ("int", True, MAX_WIDTH),
    "vocab_size": ("int", False, MAX_VOCAB),
    "intermediate_size": ("int", False, MAX_FFN_WIDTH),
    "rms_norm_eps": ("number", False, MAX_NORM_EPS),
    "rope_theta": ("number", False, MAX_ROPE_THETA),
    "tie_word_embeddings": ("bool", True, None),
    "attention_bias": ("bool", True, None),
    "mlp_bias": ("bool", True, None),
}
HF_CONFIG_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
GENERATION_FIELDS = {
    "temperature": ("number", True, 100.0),
    "top_p": ("number", True, 1.0),
    "max_new_tokens": ("int", True, MAX_VOCAB),
    "do_sample": ("bool", True, None),
}


def check_fields(config, kinds: Dict[str, Tuple[str, bool, Optional[float]]], required: Tuple[str, ...], path) -> None:
    """Raise a ValueError naming `path` and the field, for a configuration without the `required` fields, or with
    a field of `kinds` whose value is of another kind, not positive, not finite or above its bound."""
    missing = [name for name in required if name not in config]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; is it the file that came with the checkpoint?")
    for name, (kind, nullable, bound) in kinds.items():
        if name in config and not (nullable and config[name] is None):
            check_value(config[name], kind, bound, f"{path}: {name}", nullable)


def check_value(value, kind: str, bound: Optional[float], what: str, nullable: bool = False) -> None:
    """Raise a ValueError starting with `what` unless `value` is of `kind` ("int", "number" or "bool"), and for a
    number positive, finite and at most `bound`."""
    if kind == "bool":
        ok = isinstance(value, bool)
    else:
        allowed = int if kind == "int" else (int, float)
        ok = isinstance(value, allowed) and not isinstance(value, bool) and 0 < value <= bound  # NaN fails too
    if not ok:
        wanted = {"int": "a positive integer", "number": "a positive finite number", "bool": "true or false"}[kind]
        limit = "" if bound is None else f" up to {bound:,}" if kind == "int" else f" up to {bound:g}"
        raise ValueError(f"{what} must be {wanted}{limit}{' or null' if nullable else ''}, got {short_repr(value)}")


MAX_JSON_DEPTH = 32  # configuration files nest a few levels; json.loads recurses once per level


def read_json(path: Union[str, Path]) -> dict:
    """A JSON object from a file (`llama.tokenizer.files`): a local path or a blobfile URL (gs://, az://).

    Raises:
        FileNotFoundError: when nothing exists at `path`.
        ValueError: naming `path`, when it cannot be read, is not JSON, nests deeper than `MAX_JSON_DEPTH`, holds
            a key twice in one object, or is not an object.
    """
    if not files.exists(str(path)):
        raise FileNotFoundError(f"{path} not found")
    try:
        text = files.read_text(str(path))
    except OSError as e:
        raise ValueError(f"Cannot read {path}: {e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"{path} nests arrays and objects deeper than {MAX_JSON_DEPTH} levels; it is not a config")
    try:
        data = json.loads(text, object_pairs_hook=object_without_repeated_keys)
    except ValueError as e:  # JSONDecodeError, a repeated key, an integer of more than 4300 digits
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a JSON {type(data).__name__}")
    return data


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON `text` nest, in time linear in its length (for valid JSON; anything
    else gets a number that json.loads then has its own say on)."""
    # Escaped backslashes and quotes out first, so that the quotes left delimit strings; outside them, the brackets.
    outside = "".join(text.replace("\\\\", "").replace('\\"', "").split('"')[0::2])
    brackets = re.sub(r"[^\[\]{}]", "", outside)
    return max(itertools.accumulate(map(BRACKET_DEPTH.__getitem__, brackets)), default=0)


BRACKET_DEPTH = {"[": 1, "{": 1, "]": -1, "}": -1}


def object_without_repeated_keys(pairs: List[Tuple[str, object]]) -> dict:
    """A JSON object's dict, or a ValueError naming a key it holds twice (json.loads would keep the last silently)."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {short_repr(key)} appears twice in one object")
            seen.add(key)
    return data


# ModelArgs fields that are Llama.build's arguments, never a checkpoint's: ignored in params.json (with a warning).
BUILD_FIELDS = ("max_batch_size", "max_seq_len")


def model_args_from(params: dict, **overrides) -> Tuple[ModelArgs, List[str]]:
    """ModelArgs for a checkpoint's params.json fields, and the fields that were ignored: those the model does not
    have, and `BUILD_FIELDS`."""
    known = {f.name for f in fields(ModelArgs)} - set(BUILD_FIELDS)
    ignored = sorted(set(params) - known - {"tie_word_embeddings", "quantization", *VISION_FIELDS, *ENCODER_FIELDS})
    args = ModelArgs(**{k: v for k, v in params.items() if k in known}, **overrides)
    if args.head_dim % 2:
        raise ValueError(f"dim / n_heads = {args.head_dim} is odd; rotary embeddings turn a head's values in pairs")
    return args, ignored


def checked_int(name: str, value, low: int, high: Optional[int] = None) -> int:
    """`value` as a Python int, or a ValueError naming the argument `name` unless it is an int (numpy integers too;
    not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= (high or value):
        wanted = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}")
    return int(value)


def saved_quantization(params: dict, path) -> Optional[Tuple[str, Optional[int]]]:
    """(scheme, group size) of a quantized checkpoint's params.json, None for a floating-point one."""
    saved = params.get("quantization")
    if saved is None:
        return None
    scheme = saved.get("scheme") if isinstance(saved, dict) else None
    if scheme not in SCHEMES:
        raise ValueError(
            f"{path} says the checkpoint is quantized as {saved!r}, a scheme this version of llama does not know "
            f"(it knows {', '.join(SCHEMES)}); load it with the llama version that wrote it, or quantize the "
            "original checkpoint again with `python -m llama.convert quantize`"
        )
    group_size = saved.get("group_size")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{path}: quantization group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    return scheme, group_size


def generation_defaults(ckpt_dir: Union[str, Path]) -> Dict[str, object]:
    """The sampling defaults a checkpoint ships in its generation_config.json (Hugging Face folders carry one; so does
    `llama demo`'s checkpoint): "temperature" (0 where `do_sample` is false: greedy), "top_p" and "max_gen_len" (from
    `max_new_tokens`), for those it sets; {} where there is no such file. Its other fields (eos_token_id among them:
    the tokenizer's stop tokens already hold Llama's) are not read.

    Raises:
        ValueError: naming the file and the field, for a file that is not a JSON object or a field out of bounds.
    """
    path = f"{str(ckpt_dir).rstrip('/')}/{GENERATION_CONFIG}"
    try:
        config = read_json(path)
    except FileNotFoundError:
        return {}
    greedy = config.get("do_sample") is False  # then its temperature, often 0 or left over, means nothing
    check_fields(config, {k: v for k, v in GENERATION_FIELDS.items() if not (greedy and k == "temperature")}, (), path)
    defaults: Dict[str, object] = {}
    if greedy:
        defaults["temperature"] = 0.0
    elif config.get("temperature") is not None:
        defaults["temperature"] = float(config["temperature"])
    if config.get("top_p") is not None:
        defaults["top_p"] = float(config["top_p"])
    if config.get("max_new_tokens") is not None:
        defaults["max_gen_len"] = int(config["max_new_tokens"])
    return defaults
