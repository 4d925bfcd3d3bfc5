"""Checkpoint I/O in one place: Meta and Hugging Face folders, and each model-parallel rank's slice of them.

Both formats are read through a `CheckpointReader`, which names tensors with Meta's keys and knows their
full (unsharded) shapes. `rank_weights` then cuts out what one rank of a model-parallel group needs,
whatever the number of shards on disk: that is how an 8-shard 70B runs on 2 GPUs, or a 1-shard 8B on 2.
"""

import itertools
import json
import logging
import numbers
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import blobfile
import fairscale.nn.model_parallel.initialize as fs_init
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch.utils._python_dispatch import TorchDispatchMode

from llama.cuda_graphs import decode_step_bytes
from llama.distributed import free_memory, global_rank, init_model_parallel, resolve_device, resolve_dtype
from llama.model import FeedForward, ModelArgs, Transformer
from llama.progress import LoadReport, weights_bar
from llama.quantize import (
    check_device,
    check_scheme,
    layer_from_saved,
    quantize_layer,
    saved_quantization,
    saved_shapes,
    whole_shape,
)
from llama.tokenizer import Tokenizer, short_repr

logger = logging.getLogger(__name__)

# fairscale's layout: column-parallel layers (and the vocab-parallel embedding) split their weight along
# dim 0, row-parallel layers along dim 1; everything else (the norms) is replicated on every rank.
SPLIT_ON_DIM_0 = {"tok_embeddings", "output", "wq", "wk", "wv", "w1", "w3"}
SPLIT_ON_DIM_1 = {"wo", "w2"}
LINEAR_LAYERS = SPLIT_ON_DIM_0 - {"tok_embeddings"} | SPLIT_ON_DIM_1  # the ones `llama.quantize` quantizes
IGNORED_KEYS = {"rope.freqs"}  # a precomputed RoPE table some Meta checkpoints carry; we compute our own

# Hugging Face's rope_scaling fields for the Llama 3.1 rule, fixed by model.apply_scaling (only "factor" varies).
LLAMA3_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

HF_CONFIG = "config.json"
META_PARAMS = "params.json"

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


def split_dim(key: str) -> Optional[int]:
    """The dimension along which model parallelism splits the tensor `key` (None: replicated, or not a weight of a
    layer, such as a key without a dot, which the key check then names)."""
    module = key.split(".")[-2] if "." in key else None
    if module in SPLIT_ON_DIM_0:
        return 0
    if module in SPLIT_ON_DIM_1:
        return 1
    return None


def model_parallel_sizes_that_work(params: ModelArgs, upto: int = 64) -> List[int]:
    """Model-parallel sizes that divide every sharded dimension (heads, kv heads, FFN width, vocab)."""
    sizes = (params.n_heads, params.kv_heads, params.ffn_hidden_dim, params.vocab_size)
    return [m for m in range(1, upto + 1) if all(s % m == 0 for s in sizes)]


def check_model_parallel_size(
    params: ModelArgs,
    model_parallel_size: int,
    n_shards: Optional[int] = None,
    setting: str = "--nproc_per_node (or model_parallel_size)",
) -> None:
    """Raise a ValueError, telling which `setting` to change, when the model cannot be split that many ways."""
    if model_parallel_size not in model_parallel_sizes_that_work(params, upto=max(model_parallel_size, 64)):
        on_disk = f" (its checkpoint has {n_shards} shard{'s' if n_shards != 1 else ''})" if n_shards else ""
        raise ValueError(
            f"This model{on_disk} cannot be split over {model_parallel_size} model-parallel processes "
            f"(n_heads={params.n_heads}, n_kv_heads={params.kv_heads}, "
            f"vocab_size={params.vocab_size}). Sizes that work: {model_parallel_sizes_that_work(params)}. "
            f"Change {setting} to one of them."
        )


class CheckpointReader:
    """A checkpoint folder seen as full tensors with Meta's names, read lazily and in slices."""

    format: str  # "meta" or "hf"
    ckpt_dir: Path
    params: dict  # Meta params.json fields
    dtype: torch.dtype  # dtype the weights are stored in
    shapes: Dict[str, torch.Size]  # full, unsharded shapes of the model's tensors (IGNORED_KEYS left out)
    dtypes: Dict[str, torch.dtype]  # the dtype each of them is stored in

    def source(self, key: str) -> str:
        """Where `key` lives, for error messages."""
        raise NotImplementedError

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        """The tensor `key`, or its slice [start, start + length) along `dim` (in `dtype` if pieces are joined)."""
        raise NotImplementedError

    def read_shard(self, key: str, rank: int, size: int, dtype=None) -> torch.Tensor:
        """Rank `rank`'s part of `key` when the model is split over `size` model-parallel ranks (size 1: all)."""
        dim = split_dim(key)
        if dim is None or dim >= len(self.shapes[key]):  # also an int8 scale of a split row: the whole row's
            return self.read(key)
        length = self.shapes[key][dim] // size
        return self.read(key, dim, rank * length, length, dtype)


class MetaCheckpoint(CheckpointReader):
    """Meta's layout: params.json plus consolidated.NN.pth, one shard per model-parallel rank."""

    format = "meta"

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = ckpt_dir
        self.params = read_json(ckpt_dir / META_PARAMS)
        check_fields(self.params, PARAMS_FIELDS, PARAMS_REQUIRED, ckpt_dir / META_PARAMS)
        self.files = sorted(ckpt_dir.glob("*.pth"))
        if not self.files:
            raise FileNotFoundError(f"No checkpoint files (*.pth) found in {ckpt_dir}; expected consolidated.00.pth")
        self.shards = [load_shard(f) for f in self.files]
        self.shapes, self.dtypes = {}, {}
        first = self.shards[0]
        for path, shard in zip(self.files[1:], self.shards[1:]):
            if shard.keys() != first.keys():
                diff = sorted(shard.keys() ^ first.keys())
                raise ValueError(f"{path.name} and {self.files[0].name} hold different keys: {diff[:10]}")
        for key, tensor in first.items():
            if key in IGNORED_KEYS:
                continue
            for path, shard in zip(self.files[1:], self.shards[1:]):
                if shard[key].dtype != tensor.dtype:
                    raise ValueError(
                        f"{key} is {shard[key].dtype} in {path.name} but {tensor.dtype} in {self.files[0].name}; "
                        "the shards do not belong together"
                    )
            self.dtypes[key] = tensor.dtype
            dim = split_dim(key)
            shape = list(tensor.shape)
            if dim is not None and dim < len(shape):
                for path, shard in zip(self.files[1:], self.shards[1:]):
                    if shard[key].shape[dim] != tensor.shape[dim]:
                        raise ValueError(
                            f"{key} has shape {tuple(shard[key].shape)} in {path.name} but "
                            f"{tuple(tensor.shape)} in {self.files[0].name}; the shards do not belong together"
                        )
                shape[dim] *= len(self.shards)
            self.shapes[key] = torch.Size(shape)
        self.dtype = next(iter(first.values())).dtype if first else torch.bfloat16

    def source(self, key: str) -> str:
        return ", ".join(f.name for f in self.files)

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        if dim is None:
            return self.shards[0][key]
        # Gather [start, start + length) of the concatenation of all shards along `dim`.
        per_shard = self.shards[0][key].shape[dim]
        pieces, end = [], start + length
        for index, shard in enumerate(self.shards):
            lo, hi = max(start, index * per_shard), min(end, (index + 1) * per_shard)
            if lo < hi:
                pieces.append(shard[key].narrow(dim, lo - index * per_shard, hi - lo))
        if len(pieces) == 1:
            return pieces[0]
        # Join straight into the dtype asked for: no extra copy of the whole slice in the stored dtype.
        shape = list(pieces[0].shape)
        shape[dim] = length
        stored = pieces[0].dtype
        dtype = dtype if dtype is not None and stored.is_floating_point else stored  # quantized values stay ints
        return torch.cat(pieces, dim=dim, out=torch.empty(shape, dtype=dtype))


def load_shard(path: Path) -> Dict[str, torch.Tensor]:
    """A consolidated.NN.pth file's tensors, mmap-ed (nothing is read until a slice is used), or a ValueError
    naming the file when it is not a complete PyTorch checkpoint."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # whatever a damaged file makes torch raise: pickle, zip and OS errors among others
        reason = str(e).split(". ")[0].splitlines()[0] if str(e) else type(e).__name__  # torch's first sentence
        raise ValueError(
            f"{path} is not a readable PyTorch checkpoint ({reason}): it is truncated, damaged or of another format. "
            "Download it again."
        ) from e
    if not isinstance(shard, dict) or not all(isinstance(t, torch.Tensor) for t in shard.values()):
        raise ValueError(f"{path} holds {type(shard).__name__}, not a dict of tensors; it is not a Llama checkpoint")
    for key, tensor in shard.items():
        if not isinstance(key, str):
            raise ValueError(f"{path} holds a tensor under {short_repr(key)}, not a name; it is not a Llama checkpoint")
        if tensor.layout != torch.strided:
            raise ValueError(f"{key} in {path} is a {tensor.layout} tensor; a Llama checkpoint holds dense tensors")
    return shard


# Hugging Face name -> Meta name. Layer index is kept; q and k also need their rows un-permuted (see below).
HF_TO_META = {
    r"model\.embed_tokens\.weight": "tok_embeddings.weight",
    r"model\.norm\.weight": "norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"layers.\1.attention.wq.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"layers.\1.attention.wk.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"layers.\1.attention.wv.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"layers.\1.attention.wo.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"layers.\1.feed_forward.w1.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"layers.\1.feed_forward.w2.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"layers.\1.feed_forward.w3.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"layers.\1.attention_norm.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"layers.\1.ffn_norm.weight",
}


def hf_to_meta_name(name: str) -> Optional[str]:
    for pattern, replacement in HF_TO_META.items():
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def meta_to_hf_name(key: str) -> str:
    for pattern, replacement in HF_TO_META.items():
        meta_pattern = re.escape(replacement).replace(re.escape(r"\1"), r"(\d+)")
        if re.fullmatch(meta_pattern, key):
            hf = pattern.replace(r"(\d+)", r"\1").replace("\\.", ".")
            return re.sub(meta_pattern, hf, key)
    raise KeyError(f"{key} has no Hugging Face name")


# Hugging Face stores q and k with each head's rows reordered for rotate-half RoPE: the even elements of the
# interleaved pairs first, then the odd ones. These two functions move between the layouts, head by head.
def permute_for_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_for_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# hf_config_to_params and hf_config translate between the two formats' configurations, one the inverse of the other.
def hf_config_to_params(config: dict, path: Path) -> dict:
    """Meta params.json fields for a Hugging Face LlamaForCausalLM config.json."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ValueError(f"{path}: architectures must be a list of names, got {short_repr(architectures)}")
    if "LlamaForCausalLM" not in architectures and config.get("model_type") != "llama":
        raise ValueError(
            f"{path} describes {architectures or config.get('model_type')}, not a Llama model "
            "(expected architectures ['LlamaForCausalLM']); only Llama checkpoints can be loaded"
        )
    check_fields(config, HF_CONFIG_FIELDS, HF_CONFIG_REQUIRED, path)
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim * n_heads != dim:
        raise ValueError(f"{path}: head_dim {head_dim} * num_attention_heads {n_heads} != hidden_size {dim}")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{path}: {flag}=true is not a Llama 3 architecture")
    # Llama's FFN width comes from (multiple_of, ffn_dim_multiplier); pick values that give intermediate_size.
    hidden = config["intermediate_size"]
    base = int(2 * 4 * dim / 3)
    multiplier = None if base <= hidden else hidden / base
    if FeedForward.hidden_size(4 * dim, hidden, multiplier) != hidden:  # float rounding of hidden / base
        raise ValueError(f"{path}: intermediate_size {hidden} cannot be expressed as a Llama 3 FFN width")
    for name in ("rope_parameters", "rope_scaling"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise ValueError(f"{path}: {name} must be an object or null, got {short_repr(config[name])}")
    rope_field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_field) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope and not isinstance(rope_type, str):
        raise ValueError(
            f"{path}: {rope_field} has no rope_type (a name such as 'llama3' or 'default'), got {short_repr(rope)}"
        )
    if "rope_theta" in rope:
        check_value(rope["rope_theta"], "number", MAX_ROPE_THETA, f"{path}: {rope_field}.rope_theta")
    params = {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "vocab_size": config["vocab_size"],
        "multiple_of": hidden,
        "ffn_dim_multiplier": multiplier,
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
    }
    if rope_type == "llama3":
        for name, value in LLAMA3_ROPE_SCALING.items():
            if rope.get(name, value) != value:
                raise ValueError(f"{path}: rope {name}={rope[name]} is not supported (Llama 3.1 uses {value})")
        params["use_scaled_rope"] = True
        check_value(rope.get("factor", 8.0), "number", MAX_ROPE_SCALING_FACTOR, f"{path}: {rope_field}.factor")
        if rope.get("factor", 8.0) != 8.0:
            params["rope_scaling_factor"] = rope["factor"]
    elif rope_type not in (None, "default"):
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported; expected 'llama3' or none")
    return params


def hf_config(params: dict, dtype: torch.dtype) -> dict:
    """A transformers LlamaForCausalLM config.json for Meta params.json fields."""
    args, _ = model_args_from(params)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.context_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(params.get("tie_word_embeddings", False)),
        "bos_token_id": 128000,  # <|begin_of_text|>
        "eos_token_id": 128001,  # <|end_of_text|>
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.use_scaled_rope:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor or 8.0,
            **LLAMA3_ROPE_SCALING,
        }
    return config


# The safetensors dtypes a Hugging Face Llama checkpoint may store its weights in.
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class HuggingFaceCheckpoint(CheckpointReader):
    """A Hugging Face LlamaForCausalLM folder: config.json plus model*.safetensors (maybe with an index)."""

    format = "hf"

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = ckpt_dir
        self.config = read_json(ckpt_dir / HF_CONFIG)
        self.params = hf_config_to_params(self.config, ckpt_dir / HF_CONFIG)
        self.head_dim = model_args_from(self.params)[0].head_dim
        index_path = ckpt_dir / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index_path} has no weight_map of tensor names to file names")
            files = sorted(set(weight_map.values()))
            for name in files:
                key = next(k for k, v in weight_map.items() if v == name)
                inside_folder(ckpt_dir, name, f"{index_path.name} entry {key!r}")
                if not (ckpt_dir / name).is_file():
                    raise FileNotFoundError(f"{ckpt_dir / name} is missing; {index_path.name} lists it for {key}")
        else:
            files = sorted(p.name for p in ckpt_dir.glob("model*.safetensors"))
        if not files:
            raise FileNotFoundError(f"No model*.safetensors files found in {ckpt_dir}")
        self.files = {}  # Meta key -> (file name, HF name)
        self.handles = {name: open_safetensors(ckpt_dir / name) for name in files}
        self.shapes, self.dtypes, unknown = {}, {}, []
        for file_name, handle in self.handles.items():
            for hf_name in handle.keys():
                key = hf_to_meta_name(hf_name)
                if key is None:
                    unknown.append(f"{hf_name} (in {file_name})")
                    continue
                self.files[key] = (file_name, hf_name)
                tensor_slice = handle.get_slice(hf_name)
                self.shapes[key] = torch.Size(tensor_slice.get_shape())
                if tensor_slice.get_dtype() not in SAFETENSORS_DTYPES:
                    raise ValueError(
                        f"{hf_name} in {ckpt_dir / file_name} is stored as {tensor_slice.get_dtype()}; a Llama "
                        f"checkpoint's weights are floating point ({', '.join(SAFETENSORS_DTYPES)})"
                    )
                self.dtypes[key] = SAFETENSORS_DTYPES[tensor_slice.get_dtype()]
        if unknown:
            raise ValueError(f"Unexpected tensors in {ckpt_dir}, not part of a Llama model: {unknown[:10]}")
        if "output.weight" not in self.shapes and self.config.get("tie_word_embeddings"):
            self.params["tie_word_embeddings"] = True
        self.dtype = next(iter(self.dtypes.values()), torch.float32)

    def source(self, key: str) -> str:
        file_name, hf_name = self.files[key]
        return f"{file_name} ({hf_name})"

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        file_name, hf_name = self.files[key]
        tensor_slice = self.handles[file_name].get_slice(hf_name)
        if dim is None:
            return tensor_slice[:]
        tensor = tensor_slice[start : start + length] if dim == 0 else tensor_slice[:, start : start + length]
        module = key.split(".")[-2]
        if module in ("wq", "wk"):  # rows are whole heads, so each head can be un-permuted on its own
            tensor = permute_for_interleaved(tensor, tensor.shape[0] // self.head_dim)
        return tensor


def inside_folder(folder: Path, name: str, what: str) -> None:
    """Raise a ValueError naming `what` when the file `name` lies outside `folder`: an absolute path, a ".." or a
    linked subfolder that leads elsewhere. A checkpoint is read only from its own folder. The file itself may be a
    symbolic link, as Hugging Face's cache makes them (each file of a snapshot links to a shared blob)."""
    escapes = Path(name).is_absolute() or ".." in Path(name).parts
    if escapes or not (folder / name).parent.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{what} points at {name}, outside the checkpoint folder {folder}; refusing to read it")


def open_safetensors(path: Path):
    """A lazy safetensors handle, or a ValueError naming the file when it is not a complete safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file ({e}): it is truncated, damaged or of another format. "
            "Download it again."
        ) from e


MAX_JSON_DEPTH = 32  # configuration files nest a few levels; json.loads recurses once per level


def read_json(path: Union[str, Path]) -> dict:
    """A JSON object from a file, read through blobfile: a local path or a blobfile URL (gs://, az://).

    Raises:
        FileNotFoundError: when nothing exists at `path`.
        ValueError: naming `path`, when it cannot be read, is not JSON, nests deeper than `MAX_JSON_DEPTH`, holds
            a key twice in one object, or is not an object.
    """
    if not blobfile.exists(str(path)):
        raise FileNotFoundError(f"{path} not found")
    try:
        text = blobfile.read_text(str(path))
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


def open_checkpoint(ckpt_dir) -> CheckpointReader:
    """Open a Meta (params.json) or Hugging Face (config.json) checkpoint folder."""
    if not isinstance(ckpt_dir, (str, os.PathLike)):
        raise ValueError(f"ckpt_dir must be the path of a checkpoint folder, got {short_repr(ckpt_dir)}")
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.is_file():
        raise ValueError(f"{ckpt_dir} is a file; pass the folder that holds it (ckpt_dir={ckpt_dir.parent})")
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {ckpt_dir} does not exist")
    if (ckpt_dir / META_PARAMS).is_file():
        return MetaCheckpoint(ckpt_dir)
    if (ckpt_dir / HF_CONFIG).is_file():
        return HuggingFaceCheckpoint(ckpt_dir)
    raise FileNotFoundError(
        f"{ckpt_dir} has no params.json (Meta layout) and no config.json (Hugging Face layout); "
        "point ckpt_dir at the folder that holds the checkpoint"
    )


def find_tokenizer(ckpt_dir, tokenizer_path: Optional[str] = None) -> str:
    """The tokenizer file: `tokenizer_path` if given, else tokenizer.model in ckpt_dir or ckpt_dir/original.

    Raises:
        FileNotFoundError: when tokenizer_path is None and neither folder holds a tokenizer.model.
    """
    if tokenizer_path is not None:
        return str(tokenizer_path)  # checked as it is read
    candidates = [blobfile.join(str(ckpt_dir), name) for name in ("tokenizer.model", "original/tokenizer.model")]
    for candidate in candidates:
        if blobfile.exists(candidate) and not blobfile.isdir(candidate):
            return candidate
    raise FileNotFoundError(f"No tokenizer.model found (looked at {', '.join(candidates)}); pass tokenizer_path")


# ModelArgs fields that are Llama.build's arguments, never a checkpoint's: ignored in params.json (with a warning).
BUILD_FIELDS = ("max_batch_size", "max_seq_len")


def model_args_from(params: dict, **overrides) -> Tuple[ModelArgs, List[str]]:
    """ModelArgs for a checkpoint's params.json fields, and the fields that were ignored: those the model does not
    have, and `BUILD_FIELDS`."""
    known = {f.name for f in fields(ModelArgs)} - set(BUILD_FIELDS)
    ignored = sorted(set(params) - known - {"tie_word_embeddings", "quantization"})
    args = ModelArgs(**{k: v for k, v in params.items() if k in known}, **overrides)
    if args.head_dim % 2:
        raise ValueError(f"dim / n_heads = {args.head_dim} is odd; rotary embeddings turn a head's values in pairs")
    return args, ignored


def rank_weights(
    reader: CheckpointReader,
    expected_shapes: Dict[str, torch.Size],
    mp_rank: int,
    mp_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """This rank's weights, keyed like `expected_shapes` (the model's own state dict), on `device` in `dtype`,
    read one at a time as the caller asks for them (the keys and shapes are all checked first).

    Raises:
        ValueError: when keys are missing or unexpected, or a shape or dtype does not match the model.
    """
    available = set(reader.shapes)
    tied = "output.weight" not in available and "output.weight" in expected_shapes
    missing = sorted(set(expected_shapes) - available - ({"output.weight"} if tied else set()))
    unexpected = sorted(available - set(expected_shapes))
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {reader.ckpt_dir} does not match the model built from its config: "
            f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )
    for key, local_shape in expected_shapes.items():
        dim = split_dim(key)
        full_shape = list(local_shape)
        if dim is not None and dim < len(full_shape):
            full_shape[dim] *= mp_size
        if not (key == "output.weight" and tied) and list(reader.shapes[key]) != full_shape:
            raise ValueError(
                f"{key} in {reader.source(key)} has shape {tuple(reader.shapes[key])}, "
                f"but the model built from the checkpoint's config expects {tuple(full_shape)}"
            )
        if not (key == "output.weight" and tied):
            check_stored_dtype(key, reader, expected_shapes)
    embedding = None
    for key in weights_bar(expected_shapes, len(expected_shapes), global_rank()):
        if key == "output.weight" and tied:
            yield key, embedding  # the embedding, loaded under its own name
            continue
        tensor = reader.read_shard(key, mp_rank, mp_size, dtype)
        tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None).contiguous()
        if key == "tok_embeddings.weight":
            embedding = tensor
        yield key, tensor


def check_stored_dtype(key: str, reader: CheckpointReader, expected_shapes: Dict[str, torch.Size]) -> None:
    """Raise a ValueError naming `key` unless it is stored as the model needs it: floating point, or for the weight
    of a layer a quantized checkpoint stores (it has scales), int8 (int4: two values per uint8, beside zeros)."""
    stored, layer = reader.dtypes[key], key.removesuffix(".weight")
    if key.endswith(".weight") and f"{layer}.scales" in expected_shapes:
        wanted = torch.uint8 if f"{layer}.zeros" in expected_shapes else torch.int8
        ok, what = stored == wanted, f"{wanted} (quantized values)"
    else:
        ok, what = stored.is_floating_point, "floating point"
    if not ok:
        raise ValueError(f"{key} in {reader.source(key)} is stored as {stored}, but the model needs it {what}")


class AllocateOnMeta(TorchDispatchMode):
    """Inside it, every tensor is created on the meta device: no memory, no initialisation.

    `with torch.device("meta")` is not enough: fairscale allocates its weights with the legacy `torch.Tensor(rows,
    cols)` constructor, which ignores it. That allocation still reaches the dispatcher as a factory op with a
    device argument, which this mode replaces. Like every dispatch mode it is local to the thread that enters it
    and ends with the block.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs and "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return func(*args, **(kwargs or {}))


def load_model(
    reader: CheckpointReader,
    model_args: ModelArgs,
    mp_rank: int,
    mp_size: int,
    device: torch.device,
    dtype: torch.dtype,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
) -> Transformer:
    """The Transformer with this rank's weights, as Meta's code builds it (fairscale's layers), without a throwaway
    random initialisation: built on the meta device, then given the checkpoint's tensors, strictly.

    With `quantize`, each linear layer is quantized as soon as its weight is read (`llama.quantize`), so that at
    most one layer's weight is held in `dtype` at a time. A quantized checkpoint (its params.json has
    "quantization") gives its layers as they are stored, and `quantize` must then be its scheme or None.
    """
    check_model_parallel_size(model_args, mp_size, len(reader.files) if isinstance(reader, MetaCheckpoint) else None)
    saved = saved_quantization(reader.params, reader.ckpt_dir / META_PARAMS)
    if saved:
        check_quantize_matches(quantize, saved[0], reader.ckpt_dir)
        quantize, group_size = saved
    with AllocateOnMeta():
        model = Transformer(model_args)
    expected_shapes = {key: tensor.shape for key, tensor in model.state_dict().items()}
    linear = (ColumnParallelLinear, RowParallelLinear)
    stored = {name: {} for name, m in model.named_modules() if isinstance(m, linear)}  # name -> stored shapes
    if saved:
        for name in stored:
            layer = model.get_submodule(name)
            stored[name] = saved_shapes(*whole_shape(layer), isinstance(layer, RowParallelLinear), *saved, mp_size)
        expected_shapes = with_quantized_shapes(expected_shapes, stored)
    weights, parts = {}, {}
    for key, tensor in rank_weights(reader, expected_shapes, mp_rank, mp_size, dtype, device):
        name, _, field = key.rpartition(".")
        if name in stored and saved:  # a layer is built once all its stored tensors are read
            parts.setdefault(name, {})[field] = tensor
            if len(parts[name]) == len(stored[name]):
                model.set_submodule(name, layer_from_saved(model.get_submodule(name), **parts.pop(name)))
        elif name in stored and quantize:
            layer = model.get_submodule(name)
            layer.weight = torch.nn.Parameter(tensor, requires_grad=False)
            model.set_submodule(name, quantize_layer(layer, quantize, group_size))
        else:
            weights[key] = tensor
    model.load_state_dict(weights, strict=not quantize, assign=True)
    model.init_kv_caches(device, dtype)
    return model.eval()


def with_quantized_shapes(float_shapes: Dict[str, torch.Size], stored: Dict[str, dict]) -> Dict[str, torch.Size]:
    """`float_shapes` (a state dict's shapes) with each linear layer's weight replaced by the tensors a quantized
    checkpoint stores for it (`stored`: layer name -> tensor name -> shape), in the same order."""
    shapes = {}
    for key, shape in float_shapes.items():
        name = key.removesuffix(".weight")
        if name in stored:
            shapes.update({f"{name}.{field}": field_shape for field, field_shape in stored[name].items()})
        else:
            shapes[key] = shape
    return shapes


def load_checkpoint(
    ckpt_dir,
    tokenizer_path: Optional[str],
    max_seq_len: int,
    max_batch_size: int,
    model_parallel_size: Optional[int],
    seed: int,
    device: Union[str, torch.device, None],
    dtype: Union[str, torch.dtype, None],
    version: Optional[str],
    timeout: timedelta,
    quantize: Optional[str] = None,
) -> Tuple[Transformer, Tokenizer, LoadReport]:
    """The load sequence of `Llama.build` (see its docstring for the arguments): check the arguments against the
    checkpoint, join the process group, seed, read the tokenizer and this rank's weights. The report says what was
    chosen, and how long this took."""
    if tokenizer_path is not None and not isinstance(tokenizer_path, (str, os.PathLike)):
        raise ValueError(
            f"tokenizer_path must be the path of a tokenizer.model file or None, got {short_repr(tokenizer_path)}"
        )
    max_seq_len = checked_int("max_seq_len", max_seq_len, 1)
    max_batch_size = checked_int("max_batch_size", max_batch_size, 1)
    if model_parallel_size is not None:
        model_parallel_size = checked_int("model_parallel_size", model_parallel_size, 1)
    seed = checked_int("seed", seed, -(2**63), 2**64 - 1)  # what torch.manual_seed takes
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {short_repr(timeout)}")
    device = resolve_device(device)
    reader = open_checkpoint(ckpt_dir)
    tokenizer_path = find_tokenizer(ckpt_dir, tokenizer_path)
    model_args, ignored = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    if max_seq_len > model_args.context_len:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds this checkpoint's context of {model_args.context_len} tokens"
        )
    saved = saved_quantization(reader.params, reader.ckpt_dir / META_PARAMS)
    if saved:
        check_quantize_matches(quantize, saved[0], ckpt_dir)
        quantize = saved[0]
    if quantize is not None:
        check_scheme(quantize)
        if dtype is None and device.type == "cpu":
            dtype = torch.bfloat16  # what the CPU's weight-only kernels run fastest with
    dtype = resolve_dtype(reader.dtype if dtype is None and reader.format == "hf" else dtype, device)
    if quantize is not None:
        check_device(device, quantize, dtype)

    start_time = time.time()
    model_parallel_size = init_model_parallel(device, model_parallel_size, timeout)
    torch.manual_seed(seed)  # the same in all processes: they must sample the same tokens
    logger.info("Loading a %s checkpoint from %s", "Meta" if reader.format == "meta" else "Hugging Face", ckpt_dir)
    if ignored:
        logger.warning(
            "Ignoring checkpoint parameters %s: unknown to the model, or (%s) set by Llama.build's arguments",
            ignored,
            ", ".join(BUILD_FIELDS),
        )

    tokenizer = Tokenizer(tokenizer_path, version=version or ("3.1" if model_args.use_scaled_rope else "3"))
    if model_args.vocab_size != tokenizer.n_words:
        raise ValueError(
            f"The checkpoint's vocab_size ({model_args.vocab_size}) differs from the tokenizer's "
            f"({tokenizer.n_words} tokens in {tokenizer_path}); use the tokenizer.model that came with it"
        )
    check_kv_cache_fits(model_args, model_parallel_size, device, dtype)
    mp_rank = fs_init.get_model_parallel_rank()
    model = load_model(reader, model_args, mp_rank, model_parallel_size, device, dtype, quantize)
    report = LoadReport(
        reader.format, device, dtype, quantize, bool(saved), model_parallel_size, time.time() - start_time
    )
    return model, tokenizer, report


def checked_int(name: str, value, low: int, high: Optional[int] = None) -> int:
    """`value` as a Python int, or a ValueError naming the argument `name` unless it is an int (numpy integers too;
    not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= (high or value):
        wanted = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}")
    return int(value)


def check_quantize_matches(quantize: Optional[str], saved_scheme: str, ckpt_dir) -> None:
    if quantize not in (None, saved_scheme):
        raise ValueError(
            f"{ckpt_dir} holds weights quantized as {saved_scheme}; they cannot be loaded as {quantize}. Pass "
            f"quantize={saved_scheme!r} or leave it out, or convert the floating-point checkpoint to {quantize}"
        )


def check_kv_cache_fits(args: ModelArgs, mp_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError, before anything is allocated, when this process's KV cache cannot fit on `device`. On
    CUDA the activations of a decode step at the whole batch count too: a recorded CUDA graph keeps them."""
    elements = 2 * args.n_layers * args.max_batch_size * args.max_seq_len * (args.kv_heads // mp_size) * args.head_dim
    needed = elements * torch.empty(0, dtype=dtype).element_size()
    what = "The KV cache"
    if device.type == "cuda":
        needed += decode_step_bytes(args, mp_size, dtype)
        what = "The KV cache and a decode step's activations"
    free = free_memory(device)
    if free is not None and needed > free:
        raise ValueError(
            f"{what} for max_seq_len={args.max_seq_len} and max_batch_size={args.max_batch_size} needs "
            f"{needed / 2**30:.1f} GiB on {device}, which has {free / 2**30:.1f} GiB free; lower max_batch_size or "
            "max_seq_len"
        )


def full_shapes(args: ModelArgs) -> Dict[str, Tuple[int, ...]]:
    """The unsharded shape of every tensor of a Meta checkpoint for `args`, in Meta's key order."""
    head_dim, n_kv_heads, hidden = args.head_dim, args.kv_heads, args.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update(
            {
                f"layers.{i}.attention.wq.weight": (args.n_heads * head_dim, args.dim),
                f"layers.{i}.attention.wk.weight": (n_kv_heads * head_dim, args.dim),
                f"layers.{i}.attention.wv.weight": (n_kv_heads * head_dim, args.dim),
                f"layers.{i}.attention.wo.weight": (args.dim, args.n_heads * head_dim),
                f"layers.{i}.feed_forward.w1.weight": (hidden, args.dim),
                f"layers.{i}.feed_forward.w2.weight": (args.dim, hidden),
                f"layers.{i}.feed_forward.w3.weight": (hidden, args.dim),
                f"layers.{i}.attention_norm.weight": (args.dim,),
                f"layers.{i}.ffn_norm.weight": (args.dim,),
            }
        )
    shapes.update({"norm.weight": (args.dim,), "output.weight": (args.vocab_size, args.dim)})
    return shapes


def check_new_output_dir(out_dir) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists and is not empty; choose a new output folder")
    return out_dir


@contextmanager
def atomic_output_dir(out_dir) -> Iterator[Path]:
    """Write into a temporary sibling folder and rename it to `out_dir` only once everything is written,
    so a half-written folder never looks like a finished checkpoint."""
    out_dir = check_new_output_dir(out_dir)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        yield tmp_dir
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    tmp_dir.rename(out_dir)


def write_meta_checkpoint(out_dir, params: dict, tensors: Dict[str, torch.Tensor], n_shards: int = 1) -> None:
    """Write params.json and consolidated.NN.pth, split over `n_shards` the way fairscale shards them."""
    check_model_parallel_size(model_args_from(params)[0], n_shards)
    with atomic_output_dir(out_dir) as tmp_dir:
        (tmp_dir / META_PARAMS).write_text(json.dumps(params, indent=2) + "\n")
        for rank in range(n_shards):
            shard = {}
            for key, tensor in tensors.items():
                dim = split_dim(key)
                replicated = dim is None or dim >= tensor.ndim
                shard[key] = tensor if replicated else tensor.chunk(n_shards, dim=dim)[rank]
            save_shard(shard, tmp_dir / f"consolidated.{rank:02d}.pth")


def save_shard(shard: Dict[str, torch.Tensor], path: Path) -> None:
    """torch.save of exactly these tensors' bytes: a tensor that is a slice of a larger one is copied first, since
    torch.save writes the whole storage a tensor views."""
    owned = {}
    for key, tensor in shard.items():
        if tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        owned[key] = tensor
    torch.save(owned, path)
