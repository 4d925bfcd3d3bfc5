"""Hugging Face checkpoint folders: config.json and model*.safetensors read under Meta's names and layout, and the
translation between the two formats' names, q/k layouts and configurations."""

import re
from pathlib import Path
from typing import List, Optional

import torch

from llama.arguments import short_repr
from llama.checkpoint.params import (
    HF_CONFIG,
    HF_CONFIG_FIELDS,
    HF_CONFIG_REQUIRED,
    MAX_ROPE_SCALING_FACTOR,
    MAX_ROPE_THETA,
    check_fields,
    check_value,
    model_args_from,
    read_json,
)
from llama.checkpoint.shards import CheckpointReader
from llama.model import FeedForward

# Hugging Face's rope_scaling fields for the Llama 3.1 rule, fixed by model.apply_scaling (only "factor" varies).
LLAMA3_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
        self.files = {}  # Meta key -> (file name, HF name)
        self.handles = {name: open_safetensors(ckpt_dir / name) for name in safetensors_file_names(ckpt_dir)}
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
                self.dtypes[key] = stored_dtype(tensor_slice, hf_name, ckpt_dir / file_name)
        if unknown:
            raise ValueError(f"Unexpected tensors in {ckpt_dir}, not part of a Llama model: {unknown[:10]}")
        if "output.weight" not in self.shapes and self.config.get("tie_word_embeddings"):
            self.params["tie_word_embeddings"] = True
        self.dtype = next(iter(self.dtypes.values()), torch.float32)

    def source(self, key: str) -> str:
        file_name, hf_name = self.files[key]
        return f"{file_name} ({hf_name})"

    def mapped_files(self) -> List[Path]:
        return [self.ckpt_dir / name for name in self.handles]  # safetensors maps each file it opens

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


def safetensors_file_names(ckpt_dir: Path) -> List[str]:
    """The weight files of a Hugging Face folder: those its model.safetensors.index.json names (each checked to lie
    in the folder and to exist), or without an index every model*.safetensors there; a FileNotFoundError if none."""
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
    return files


def stored_dtype(tensor_slice, hf_name: str, path: Path) -> torch.dtype:
    """The torch dtype of a safetensors tensor, or a ValueError naming it when it is not floating point."""
    if tensor_slice.get_dtype() not in SAFETENSORS_DTYPES:
        raise ValueError(
            f"{hf_name} in {path} is stored as {tensor_slice.get_dtype()}; a Llama "
            f"checkpoint's weights are floating point ({', '.join(SAFETENSORS_DTYPES)})"
        )
    return SAFETENSORS_DTYPES[tensor_slice.get_dtype()]


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
