"""config.json of a Hugging Face Mllama folder (transformers' `MllamaForConditionalGeneration`) and params.json of
a Meta-layout Llama 3.2 Vision checkpoint, each translated to the other (the tensors: `llama.checkpoint.hf_mllama`).

text_config is a Llama text config but for its layer count, which counts the cross-attention blocks too; their
numbers (`cross_attention_layers`) must be where Meta's `fusion_schedule` puts them. vision_config holds the encoder's
sizes: Meta's fixed ones (1,280 wide, 32 + 8 layers, 16 heads) need no params.json field, and any other is written
with this library's `vision_encoder_*` fields, which Meta's code does not read.
"""

from dataclasses import fields
from typing import List, Tuple

import torch

from llama.arguments import short_repr
from llama.checkpoint.hf import LLAMA3_ROPE_SCALING, hf_config_to_params
from llama.checkpoint.params import HF_CONFIG_FIELDS, MAX_LAYERS, MAX_WIDTH, check_fields, model_args_from
from llama.vision.encoder import MAX_TILES, EncoderArgs
from llama.vision.model import ENCODER_FIELDS, fusion_schedule, vision_args_from

ARCHITECTURE = "MllamaForConditionalGeneration"
CHANNELS = 3
META_ENCODER = {f.name: f.default for f in fields(EncoderArgs) if f.name != "tile_size"}  # Meta's fixed sizes
LAYER_NORM_EPS = 1e-5  # torch's default, which Meta's encoder uses
VISION_CONFIG_FIELDS = {  # with transformers' defaults (MllamaVisionConfig) where config.json leaves one out
    "hidden_size": 1280,
    "num_hidden_layers": 32,
    "attention_heads": 16,
    "num_global_layers": 8,
    "intermediate_size": 5120,
    "vision_output_dim": 7680,
    "image_size": 448,
    "patch_size": 14,
    "max_num_tiles": 4,
    "num_channels": 3,
}


def is_mllama_config(config: dict) -> bool:
    """Whether a config.json describes a Llama 3.2 Vision model in transformers' Mllama classes."""
    architectures = config.get("architectures")
    return config.get("model_type") == "mllama" or (isinstance(architectures, list) and ARCHITECTURE in architectures)


def aspect_ratios(max_tiles: int = MAX_TILES) -> List[Tuple[int, int]]:
    """Every grid of at most `max_tiles` tiles as (tiles high, tiles wide), in transformers' order: aspect ratio
    id r + 1 is the r-th (1 is one tile, 2 one high and two wide)."""
    sides = range(1, max_tiles + 1)
    return [(high, wide) for high in sides for wide in sides if high * wide <= max_tiles]


def hf_layer_numbers(n_layers: int, cross_attention_layers: int) -> Tuple[List[int], List[int]]:
    """Hugging Face's number of each self-attention layer and of each cross-attention block: block b comes just
    before the self-attention layer `fusion_schedule` runs it before."""
    schedule = fusion_schedule(n_layers, cross_attention_layers)
    blocks = [layer + block for block, layer in enumerate(schedule)]
    return [i for i in range(n_layers + len(schedule)) if i not in blocks], blocks


def mllama_config_to_params(config: dict, path) -> dict:
    """Meta params.json fields for a transformers MllamaForConditionalGeneration config.json (with this library's
    `vision_encoder_*` fields for the encoder sizes that are not Meta's, and only those)."""
    text, vision = config.get("text_config"), config.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ValueError(f"{path}: an Mllama config.json needs text_config and vision_config objects")
    check_fields(text, HF_CONFIG_FIELDS, ("num_hidden_layers",), f"{path}: text_config")
    vision = {**VISION_CONFIG_FIELDS, **vision}
    kinds = {name: ("int", False, MAX_WIDTH) for name in VISION_CONFIG_FIELDS}
    check_fields(vision, kinds, (), f"{path}: vision_config")
    blocks = text.get("cross_attention_layers", [3, 8, 13, 18, 23, 28, 33, 38])  # transformers' default
    total = text["num_hidden_layers"]
    if not isinstance(blocks, list) or not blocks or any(type(b) is not int or not 0 <= b < total for b in blocks):
        raise ValueError(
            f"{path}: text_config.cross_attention_layers must list layer numbers below num_hidden_layers ({total}), "
            f"got {short_repr(blocks)}"
        )
    n_layers = total - len(blocks)
    expected = hf_layer_numbers(n_layers, len(blocks))[1] if 0 < len(blocks) <= n_layers else None
    if blocks != expected:
        raise ValueError(
            f"{path}: text_config.cross_attention_layers {blocks} are not where Meta's code runs {len(blocks)} "
            f"cross-attention blocks among {n_layers} self-attention layers ({expected}); Meta's layout cannot "
            "express this model"
        )
    params = hf_config_to_params({**text, "model_type": "llama", "num_hidden_layers": n_layers}, f"{path}: text_config")
    fixed = {"patch_size": META_ENCODER["patch_size"], "num_channels": CHANNELS, "max_num_tiles": MAX_TILES}
    for name, value in fixed.items():
        if vision[name] != value:
            raise ValueError(f"{path}: vision_config.{name} is {vision[name]}; Llama 3.2 Vision's is {value}")
    layers = vision.get("intermediate_layers_indices", list(META_ENCODER["intermediate_layers"]))
    width = vision["hidden_size"]
    if not isinstance(layers, list) or any(type(i) is not int or not 0 <= i < MAX_LAYERS for i in layers):
        raise ValueError(f"{path}: vision_config.intermediate_layers_indices must list layer numbers, got {layers!r}")
    sizes = {"intermediate_size": 4 * width, "vision_output_dim": width * (len(layers) + 1)}
    for name, value in sizes.items():
        if vision[name] != value:
            raise ValueError(f"{path}: vision_config.{name} is {vision[name]}; a Llama 3.2 Vision encoder's is {value}")
    given = vision.get("supported_aspect_ratios", aspect_ratios())
    ratios = [tuple(r) for r in given if isinstance(r, (list, tuple))] if isinstance(given, list) else None
    if ratios is None or len(ratios) != len(given) or sorted(ratios, key=str) != sorted(aspect_ratios(), key=str):
        raise ValueError(
            f"{path}: vision_config.supported_aspect_ratios must be every grid of up to {MAX_TILES} tiles "
            f"({aspect_ratios()}), as images are cut into; got {short_repr(given)}"
        )
    if vision.get("hidden_act", "gelu") != "gelu" or vision.get("norm_eps", LAYER_NORM_EPS) != LAYER_NORM_EPS:
        raise ValueError(f"{path}: vision_config must have hidden_act 'gelu' and norm_eps {LAYER_NORM_EPS}, as Meta's")
    params.update(
        vision_chunk_size=vision["image_size"],
        vision_max_num_chunks=MAX_TILES,
        vision_num_cross_attention_layers=len(blocks),
    )
    encoder = {
        "width": width,
        "layers": vision["num_hidden_layers"],
        "heads": vision["attention_heads"],
        "global_layers": vision["num_global_layers"],
        "intermediate_layers": layers,
    }
    for name, attribute in ENCODER_FIELDS.items():
        value, meta_value = encoder[attribute], META_ENCODER[attribute]
        if (list(value) != list(meta_value)) if attribute == "intermediate_layers" else value != meta_value:
            params[name] = value  # Meta's code cannot express it: this library's own field
    return params


def mllama_config(params: dict, dtype: torch.dtype) -> dict:
    """A transformers MllamaForConditionalGeneration config.json for Meta params.json fields of a vision model."""
    args, _ = model_args_from(params)
    vision = vision_args_from(params, args.n_layers)
    layers, blocks = hf_layer_numbers(args.n_layers, vision.cross_attention_layers)
    text = {
        "model_type": "mllama_text_model",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "hidden_act": "silu",
        "num_hidden_layers": len(layers) + len(blocks),
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.ffn_hidden_dim,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.context_len,
        "cross_attention_layers": blocks,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,  # <|begin_of_text|>
        "eos_token_id": 128001,  # <|end_of_text|>
        "pad_token_id": 128004,  # <|finetune_right_pad_id|>
    }
    if args.use_scaled_rope:
        text["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor or 8.0, **LLAMA3_ROPE_SCALING}
    encoder = vision.encoder
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "mllama",
        "image_token_index": args.vocab_size,  # learnable_embedding's first row, in embed_tokens
        "text_config": text,
        "vision_config": {
            "model_type": "mllama_vision_model",
            "hidden_size": encoder.width,
            "hidden_act": "gelu",
            "num_hidden_layers": encoder.layers,
            "num_global_layers": encoder.global_layers,
            "attention_heads": encoder.heads,
            "num_channels": CHANNELS,
            "intermediate_size": 4 * encoder.width,
            "vision_output_dim": encoder.feature_dim,
            "image_size": encoder.tile_size,
            "patch_size": encoder.patch_size,
            "norm_eps": LAYER_NORM_EPS,
            "max_num_tiles": MAX_TILES,
            "intermediate_layers_indices": list(encoder.intermediate_layers),
            "supported_aspect_ratios": [list(r) for r in aspect_ratios()],
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
