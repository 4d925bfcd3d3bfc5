"""Llama 3.2 Vision in Hugging Face's Mllama layout (transformers' `MllamaForConditionalGeneration`): config.json
and model*.safetensors read under Meta's keys, and written from a Meta-layout checkpoint.

`mllama_names` is the one table of the translation: each Meta key, the Hugging Face tensor that holds it, and how
it is laid out there. What differs from Meta's layout:

- The text model numbers its layers with the cross-attention blocks among the self-attention layers: a block sits
  just before the layer Meta's `fusion_schedule` runs it before, and text_config's `cross_attention_layers` lists
  the blocks' numbers (11B: 3, 8, ..., 38 of 40). Meta keeps `layers.N` and `cross_attention_layers.M` apart.
- The self-attention layers' q and k rows are permuted for rotate-half RoPE (as in a text Llama). The cross-
  attention's q and k, which have no RoPE, and the encoder's are stored as Meta's (transformers' converter leaves
  them, and their q_norm and k_norm, as they are).
- `learnable_embedding` (8 rows, the first the `<|image|>` token's) follows the vocabulary in `embed_tokens`:
  HF's image token is 128256 (as Meta's chat format gives the model), where this library's prompts hold the
  tokenizer's `<|image|>` (128011).
- The tile-position embeddings (pre and post, one vector a tile) and the gated positional embedding (one per token
  of each tile) are stored per aspect ratio: row r + 1 holds, for vision_config's `supported_aspect_ratios[r]`
  (tiles high, tiles wide), the embeddings of that grid's tiles, row-major, then zeros up to 4 tiles; row 0 (no
  image) is zeros. Meta's (4, 4, ...) tables are indexed by tile row and column; the 8 positions no grid of at
  most 4 tiles reaches, such as (1, 2), have no place in Hugging Face's layout and read back as zeros.
- The gates are stored as Meta's: raw parameters, tanh applied in both models' forward passes.
- The patch embedding is a convolution's weight (width, 3, 14, 14) where Meta's is the linear layer after unfold.
- Names: `language_model.model.*`, `language_model.lm_head`, `vision_model.*` and `multi_modal_projector.*`, as
  the released checkpoints and transformers' `save_pretrained` name them; the names of a transformers 5 model's
  `state_dict` (`model.language_model.*`, `lm_head`, ...) are read too.
"""

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from llama.checkpoint.hf import (
    HuggingFaceCheckpoint,
    open_safetensors,
    permute_for_interleaved,
    permute_for_rotate_half,
    safetensors_file_names,
    stored_dtype,
)
from llama.checkpoint.hf_mllama_config import (
    CHANNELS,
    aspect_ratios,
    hf_layer_numbers,
    is_mllama_config,
    mllama_config,
    mllama_config_to_params,
)
from llama.checkpoint.params import HF_CONFIG, model_args_from, read_json
from llama.checkpoint.vision_shapes import full_vision_shapes
from llama.model import ModelArgs
from llama.vision.encoder import MAX_TILES
from llama.vision.model import LEARNABLE_EMBEDDINGS, VisionArgs, vision_args_from

# How a tensor is laid out in Hugging Face's file against Meta's: as it is, q/k rows permuted for rotate-half RoPE,
# a convolution's weight, rows of the joined embedding table, or packed per aspect ratio.
SAME, ROPE, CONV, ROWS, TILES = "same", "rope", "conv", "rows", "tiles"

FEED_FORWARD_AND_NORMS = [  # the same in a self-attention layer and a cross-attention block
    ("feed_forward.w1.weight", "mlp.gate_proj.weight", SAME),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", SAME),
    ("feed_forward.w3.weight", "mlp.up_proj.weight", SAME),
    ("attention_norm.weight", "input_layernorm.weight", SAME),
    ("ffn_norm.weight", "post_attention_layernorm.weight", SAME),
]
TEXT_LAYER = [  # Meta's name in a self-attention layer, HF's, layout
    ("attention.wq.weight", "self_attn.q_proj.weight", ROPE),
    ("attention.wk.weight", "self_attn.k_proj.weight", ROPE),
    ("attention.wv.weight", "self_attn.v_proj.weight", SAME),
    ("attention.wo.weight", "self_attn.o_proj.weight", SAME),
    *FEED_FORWARD_AND_NORMS,
]
CROSS_ATTENTION_BLOCK = [
    *((f"attention.w{x}.weight", f"cross_attn.{x}_proj.weight", SAME) for x in "qkvo"),  # no RoPE: not permuted
    ("attention.q_norm.weight", "cross_attn.q_norm.weight", SAME),
    ("attention.k_norm.weight", "cross_attn.k_norm.weight", SAME),
    ("gate_attn", "cross_attn_attn_gate", SAME),
    ("gate_ffwd", "cross_attn_mlp_gate", SAME),
    *FEED_FORWARD_AND_NORMS,
]
ENCODER_LAYER = [
    *((f"attn.w{x}.weight", f"self_attn.{x}_proj.weight", SAME) for x in "qkvo"),
    *((f"mlp.c_fc.{p}", f"mlp.fc1.{p}", SAME) for p in ("weight", "bias")),
    *((f"mlp.c_proj.{p}", f"mlp.fc2.{p}", SAME) for p in ("weight", "bias")),
    *((f"ln_1.{p}", f"input_layernorm.{p}", SAME) for p in ("weight", "bias")),
    *((f"ln_2.{p}", f"post_attention_layernorm.{p}", SAME) for p in ("weight", "bias")),
]
PRE_POST = ("pre", "post")
GLOBAL_LAYER = ENCODER_LAYER + [("gate_attn", "gate_attn", SAME), ("gate_ffn", "gate_ffn", SAME)]
ENCODER = [  # under Meta's vision_model.vision_encoder. and HF's vision_model.
    ("conv1._linear.weight", "patch_embedding.weight", CONV),
    ("class_embedding", "class_embedding", SAME),
    ("positional_embedding", "gated_positional_embedding.embedding", SAME),
    ("gated_positional_embedding", "gated_positional_embedding.tile_embedding.weight", TILES),
    ("gated_positional_embedding_gate", "gated_positional_embedding.gate", SAME),
    *((f"ln_{x}.{p}", f"layernorm_{x}.{p}", SAME) for x in ("pre", "post") for p in ("weight", "bias")),
    *((f"{x}_tile_pos_embed.embedding", f"{x}_tile_positional_embedding.embedding.weight", TILES) for x in PRE_POST),
    *((f"{x}_tile_pos_embed.gate", f"{x}_tile_positional_embedding.gate", SAME) for x in PRE_POST),
]
# A transformers 5 model's state_dict names -> the released checkpoints' names, which `mllama_names` gives.
NEW_PREFIXES = [
    ("model.language_model.", "language_model.model."),
    ("model.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
]


def mllama_names(args: ModelArgs, vision: VisionArgs) -> Dict[str, Tuple[str, str]]:
    """Meta key -> (Hugging Face name, layout), for every tensor of the model, in Meta's key order."""
    text = "language_model.model"
    names = {
        "text_model.tok_embeddings.weight": (f"{text}.embed_tokens.weight", ROWS),
        "text_model.learnable_embedding.weight": (f"{text}.embed_tokens.weight", ROWS),
        "text_model.norm.weight": (f"{text}.norm.weight", SAME),
        "text_model.output.weight": ("language_model.lm_head.weight", SAME),
        "vision_model.vision_projection.weight": ("multi_modal_projector.weight", SAME),
        "vision_model.vision_projection.bias": ("multi_modal_projector.bias", SAME),
    }
    layers, blocks = hf_layer_numbers(args.n_layers, vision.cross_attention_layers)
    for table, prefix, numbers in (
        (TEXT_LAYER, "text_model.layers", layers),
        (CROSS_ATTENTION_BLOCK, "text_model.cross_attention_layers", blocks),
    ):
        for index, number in enumerate(numbers):
            names.update({f"{prefix}.{index}.{m}": (f"{text}.layers.{number}.{h}", how) for m, h, how in table})
    for stack, table, count in (
        ("transformer", ENCODER_LAYER, vision.encoder.layers),
        ("global_transformer", GLOBAL_LAYER, vision.encoder.global_layers),
    ):
        for i in range(count):
            meta, hf = f"vision_model.vision_encoder.{stack}.resblocks.{i}", f"vision_model.{stack}.layers.{i}"
            names.update({f"{meta}.{m}": (f"{hf}.{h}", how) for m, h, how in table})
    names.update({f"vision_model.vision_encoder.{m}": (f"vision_model.{h}", how) for m, h, how in ENCODER})
    return {key: names[key] for key in full_vision_shapes(args, vision)}


def hf_shape(meta_shape: Tuple[int, ...], how: str, args: ModelArgs, vision: VisionArgs) -> Tuple[int, ...]:
    """The shape of the Hugging Face tensor that holds a Meta tensor of `meta_shape` laid out as `how`."""
    if how == ROWS:
        return (args.vocab_size + LEARNABLE_EMBEDDINGS, args.dim)
    if how == CONV:
        return (meta_shape[0], CHANNELS, vision.encoder.patch_size, vision.encoder.patch_size)
    if how == TILES:  # (MAX_TILES, MAX_TILES, tokens, width): a row per aspect ratio, and one for none
        return (len(aspect_ratios()) + 1, MAX_TILES * meta_shape[2] * meta_shape[3])
    return tuple(meta_shape)


def pack_tiles(embedding: torch.Tensor, ratios: List[Tuple[int, int]]) -> torch.Tensor:
    """Meta's (MAX_TILES, MAX_TILES, tokens, width) tile embedding as Hugging Face's per-aspect-ratio rows."""
    _, _, tokens, width = embedding.shape
    packed = embedding.new_zeros(len(ratios) + 1, MAX_TILES, tokens, width)
    for row, (high, wide) in enumerate(ratios, start=1):
        packed[row, : high * wide] = embedding[:high, :wide].reshape(high * wide, tokens, width)
    return packed.flatten(1)


def unpack_tiles(packed: torch.Tensor, ratios: List[Tuple[int, int]], tokens: int, what: str) -> torch.Tensor:
    """Hugging Face's per-aspect-ratio rows as Meta's (MAX_TILES, MAX_TILES, tokens, width) tile embedding, or a
    ValueError naming `what` when they cannot be one: two grids giving the same tile position different values,
    or a grid giving a value to a tile it does not have (a model trained in Hugging Face's layout may)."""
    rows = packed.view(len(ratios) + 1, MAX_TILES, tokens, -1)
    embedding = rows.new_zeros(MAX_TILES, MAX_TILES, tokens, rows.shape[-1])
    seen = torch.zeros(MAX_TILES, MAX_TILES, dtype=torch.bool)
    for row, (high, wide) in enumerate(ratios, start=1):
        tiles = rows[row, : high * wide].reshape(high, wide, tokens, -1)
        known = seen[:high, :wide]
        if rows[row, high * wide :].any() or not torch.equal(tiles[known], embedding[:high, :wide][known]):
            raise ValueError(
                f"{what}: the embeddings of aspect ratio {row} ({high}x{wide} tiles) differ from the other aspect "
                "ratios' for the same tile positions, or fill tiles the grid does not have. Meta's layout holds one "
                "embedding per tile position, so this model cannot be read as a Llama 3.2 Vision checkpoint"
            )
        embedding[:high, :wide] = tiles
        seen[:high, :wide] = True
    return embedding


def released_name(name: str) -> str:
    """A tensor name as the released checkpoints give it, for one saved under a transformers 5 model's names."""
    for new, old in NEW_PREFIXES:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


class MllamaCheckpoint(HuggingFaceCheckpoint):
    """A Hugging Face MllamaForConditionalGeneration folder, read under Meta's keys and in Meta's layout."""

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = ckpt_dir
        self.config = read_json(ckpt_dir / HF_CONFIG)
        self.params = mllama_config_to_params(self.config, ckpt_dir / HF_CONFIG)
        self.args = model_args_from(self.params)[0]
        self.vision = vision_args_from(self.params, self.args.n_layers)
        self.head_dim = self.args.head_dim
        self.names = mllama_names(self.args, self.vision)
        given = (self.config.get("vision_config") or {}).get("supported_aspect_ratios", aspect_ratios())
        self.ratios = [tuple(r) for r in given]  # checked by mllama_config_to_params
        meta_shapes = full_vision_shapes(self.args, self.vision)
        expected = {}  # HF name -> shape
        for key, (hf, how) in self.names.items():
            expected[hf] = hf_shape(meta_shapes[key], how, self.args, self.vision)
        self.handles = {name: open_safetensors(ckpt_dir / name) for name in safetensors_file_names(ckpt_dir)}
        stored, unknown = {}, []  # released name -> (file name, name in the file)
        for file_name, handle in self.handles.items():
            for name in handle.keys():
                hf = released_name(name)
                if hf not in expected:
                    unknown.append(f"{name} (in {file_name})")
                    continue
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[hf]:
                    raise ValueError(
                        f"{name} in {ckpt_dir / file_name} has shape {shape}, but the model its config.json describes "
                        f"needs {expected[hf]}"
                    )
                stored[hf] = (file_name, name)
        if unknown:
            raise ValueError(f"Unexpected tensors in {ckpt_dir}, not part of a Llama 3.2 Vision model: {unknown[:10]}")
        missing = [name for name in expected if name not in stored]
        if missing:
            raise ValueError(f"{ckpt_dir} lacks tensors of the model its config.json describes: {missing[:10]}")
        self.files, self.shapes, self.dtypes = {}, {}, {}
        for key, (hf, _) in self.names.items():
            file_name, name = self.files[key] = stored[hf]
            self.shapes[key] = torch.Size(meta_shapes[key])
            self.dtypes[key] = stored_dtype(self.handles[file_name].get_slice(name), name, ckpt_dir / file_name)
        self.dtype = next(iter(self.dtypes.values()), torch.float32)

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        file_name, name = self.files[key]
        tensor_slice = self.handles[file_name].get_slice(name)
        how = self.names[key][1]
        if how == ROWS:  # the vocabulary's rows, then learnable_embedding's
            first = 0 if key == "text_model.tok_embeddings.weight" else self.args.vocab_size
            start, length = (start, length) if dim is not None else (0, self.shapes[key][0])
            return tensor_slice[first + start : first + start + length]
        if how == TILES:  # never split: read whole
            tokens = self.shapes[key][2]
            tensor = unpack_tiles(tensor_slice[:], self.ratios, tokens, f"{name} in {self.ckpt_dir / file_name}")
            return tensor if dim is None else tensor.narrow(dim, start, length)
        if dim is None:
            tensor = tensor_slice[:]
        else:
            tensor = tensor_slice[start : start + length] if dim == 0 else tensor_slice[:, start : start + length]
        if how == ROPE:  # rows are whole heads, so each head can be un-permuted on its own
            tensor = permute_for_interleaved(tensor, tensor.shape[0] // self.head_dim)
        elif how == CONV:
            tensor = tensor.reshape(tensor.shape[0], -1)
        return tensor


class MllamaWriter:
    """The Hugging Face Mllama tensors of a Meta-layout vision checkpoint, one at a time (`llama convert to-hf`)."""

    def __init__(self, reader, dtype: torch.dtype):
        self.reader = reader
        self.config = mllama_config(reader.params, dtype)
        self.args = model_args_from(reader.params)[0]
        self.vision = vision_args_from(reader.params, self.args.n_layers)
        meta_shapes = full_vision_shapes(self.args, self.vision)
        found = {key: tuple(shape) for key, shape in reader.shapes.items()}
        if found != meta_shapes:
            wrong = sorted(set(found.items()) ^ set(meta_shapes.items()))
            raise ValueError(
                f"{reader.ckpt_dir} does not hold the tensors of the vision model its params.json describes "
                f"(differences: {wrong[:6]}); Hugging Face's Mllama layout needs every one, output.weight included"
            )
        self.sources: Dict[str, List[Tuple[str, str]]] = {}  # HF name -> [(Meta key, layout)]
        self.shapes: Dict[str, torch.Size] = {}
        for key, (hf, how) in mllama_names(self.args, self.vision).items():
            self.sources.setdefault(hf, []).append((key, how))
            self.shapes[hf] = torch.Size(hf_shape(meta_shapes[key], how, self.args, self.vision))

    def tensor(self, hf: str) -> torch.Tensor:
        parts = [(self.reader.read_shard(key, 0, 1), how) for key, how in self.sources[hf]]
        tensor, how = parts[0]
        if how == ROWS:  # tok_embeddings, then learnable_embedding (Meta's key order)
            tensor = torch.cat([part for part, _ in parts])
        elif how == ROPE:
            tensor = permute_for_rotate_half(tensor, tensor.shape[0] // self.args.head_dim)
        elif how == CONV:
            tensor = tensor.reshape(self.shapes[hf])
        elif how == TILES:
            tensor = pack_tiles(tensor, aspect_ratios())
        if tuple(tensor.shape) != tuple(self.shapes[hf]):
            raise AssertionError(f"{hf}: made {tuple(tensor.shape)}, expected {tuple(self.shapes[hf])}")
        return tensor.contiguous()


def open_hf_folder(ckpt_dir: Path) -> HuggingFaceCheckpoint:
    """The reader of a Hugging Face folder: a Llama 3.2 Vision one's (Mllama) or a text Llama's."""
    config = read_json(ckpt_dir / HF_CONFIG)
    return MllamaCheckpoint(ckpt_dir) if is_mllama_config(config) else HuggingFaceCheckpoint(ckpt_dir)
