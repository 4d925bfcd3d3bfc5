"""Llama 3.2 Vision: the Llama 3 text model with cross-attention layers that read an image's encoded tiles.

`CrossAttentionTransformer` holds the vision model (`llama.vision.encoder`: tiles to tokens of the text model's
width) and the text model. The text model is `llama.model.Transformer` with, before some of its layers, a
cross-attention block: the text's queries attend to the image tokens' keys and values, computed once per image
(`llama.vision.batch`), and the block's output passes through a tanh gate. Text positions that see no image skip
it: their rows of the block's output are zeroed. The image itself stands in the prompt as one `<|image|>` token,
embedded by a row of `learnable_embedding`. Module names are Meta's checkpoint keys (its llama-models
`CrossAttentionTransformer`), and the layers are split over model-parallel processes as Meta's are.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from torch import nn

from llama.model import FeedForward, ModelArgs, RMSNorm, Transformer, causal_mask
from llama.vision.encoder import MAX_TILES, EncoderArgs, VisionModel, unused_init

# The tokenizer's <|image|>: where an image stands in a prompt. Meta's chat format hands the model 128256 in its
# place, the first row of `learnable_embedding`; here the model maps it to that row itself.
IMAGE_TOKEN_ID = 128011
LEARNABLE_EMBEDDINGS = 8  # rows of `learnable_embedding`; only the first is used

# params.json's vision fields: Meta's, then this library's own encoder sizes (never in Meta's files).
VISION_FIELDS = ("vision_chunk_size", "vision_max_num_chunks", "vision_num_cross_attention_layers")
ENCODER_FIELDS = {
    "vision_encoder_width": "width",
    "vision_encoder_layers": "layers",
    "vision_encoder_heads": "heads",
    "vision_encoder_global_layers": "global_layers",
    "vision_encoder_intermediate_layers": "intermediate_layers",
}


@dataclass
class VisionArgs:
    cross_attention_layers: int  # vision_num_cross_attention_layers: 8 in 11B, 20 in 90B
    encoder: EncoderArgs = field(repr=False)


def holds_vision_model(params: dict) -> bool:
    """Whether a checkpoint's params (params.json's fields, or a Hugging Face config read as them) are a Llama 3.2
    Vision model's: `vision_chunk_size` set, and not to -1, Meta's default for a text model."""
    return params.get("vision_chunk_size", -1) != -1


# Bounds of the vision fields, far above Llama 3.2 Vision's (tiles of 560 pixels; an encoder 1,280 wide, 32 + 8
# layers, 16 heads) and low enough that every size computed from them stays exact: a bad value is named here.
MAX_TILE_SIZE = 2**13
MAX_ENCODER_SIZES = {"width": 2**16, "layers": 2**10, "heads": 2**10, "global_layers": 2**10}


def checked_size(name: str, value, bound: int, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= bound:
        raise ValueError(f"params.json: {name} must be an integer from {low} to {bound:,}, got {value!r}")
    return value


def vision_args_from(params: dict, n_layers: int) -> Optional[VisionArgs]:
    """The vision fields of a params.json (None for a text model: no `vision_chunk_size`, or -1 as in Meta's
    defaults); a ValueError names a field that cannot work."""
    if not holds_vision_model(params):
        extra = sorted(set(params) & (set(VISION_FIELDS[1:]) | set(ENCODER_FIELDS)))
        if extra:
            raise ValueError(f"params.json sets {extra} but no vision_chunk_size; a vision model needs it")
        return None
    tile_size = checked_size("vision_chunk_size", params["vision_chunk_size"], MAX_TILE_SIZE)
    if params.get("vision_max_num_chunks", MAX_TILES) != MAX_TILES:
        raise ValueError(
            f"params.json: vision_max_num_chunks is {params['vision_max_num_chunks']!r}; Llama 3.2 Vision's encoder "
            f"has tile embeddings for {MAX_TILES} tiles exactly"
        )
    name = "vision_num_cross_attention_layers"
    cross_attention_layers = checked_size(name, params.get(name), n_layers)
    sizes = {}
    for name, attribute in ENCODER_FIELDS.items():
        if name not in params:
            continue
        if attribute == "intermediate_layers":
            layers = params[name]
            if not isinstance(layers, list) or not layers:
                raise ValueError(f"params.json: {name} must be a list of layer indices, got {layers!r}")
            sizes[attribute] = tuple(checked_size(name, i, MAX_ENCODER_SIZES["layers"], low=0) for i in layers)
        else:
            sizes[attribute] = checked_size(name, params[name], MAX_ENCODER_SIZES[attribute])
    encoder = EncoderArgs(tile_size=tile_size, **sizes)
    return VisionArgs(cross_attention_layers, encoder)


def fusion_schedule(n_layers: int, cross_attention_layers: int) -> List[int]:
    """The text layers that a cross-attention block runs before: spread evenly, counted from the last layer (Meta's
    schedule: 3, 7, 11, ..., 31 for 11B's 32 layers and 8 blocks)."""
    step = math.ceil(n_layers / cross_attention_layers)
    return list(range(n_layers))[::-1][::step][:cross_attention_layers][::-1]


class CrossAttention(nn.Module):
    """Attention from the text's positions to an image's tokens: no RoPE (the image tokens carry their own
    positions), RMSNorm on each query and key head, and grouped-query heads as in the text layers."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        model_parallel_size = fs_init.get_model_parallel_world_size()
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = args.kv_heads // model_parallel_size
        self.head_dim = args.head_dim
        kv_dim = args.kv_heads * self.head_dim
        self.wq = ColumnParallelLinear(args.dim, args.dim, bias=False, gather_output=False, init_method=unused_init)
        self.wk = ColumnParallelLinear(args.dim, kv_dim, bias=False, gather_output=False, init_method=unused_init)
        self.wv = ColumnParallelLinear(args.dim, kv_dim, bias=False, gather_output=False, init_method=unused_init)
        self.wo = RowParallelLinear(args.dim, args.dim, bias=False, input_is_parallel=True, init_method=unused_init)
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps)

    def image_keys_values(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """Keys and values of an image's tokens (n, dim), stacked: (2, n_local_kv_heads, n, head_dim). They are kept
        at the kv heads' count: Meta's code copies each to every query head it serves (4x the memory in 11B)."""
        n = image_tokens.shape[0]
        keys = self.k_norm(self.wk(image_tokens).view(n, self.n_local_kv_heads, self.head_dim))
        values = self.wv(image_tokens).view(n, self.n_local_kv_heads, self.head_dim)
        return torch.stack([keys, values]).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sees_image: torch.Tensor
    ) -> torch.Tensor:
        """`keys`, `values`: (bsz, n_local_kv_heads, image tokens, head_dim); `mask` (bsz, 1, seqlen, image tokens)
        is added to the scores; `sees_image` (bsz, 1, seqlen, 1) is 0 for the positions that see no image."""
        bsz, seqlen, _ = x.shape
        xq = self.q_norm(self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)).transpose(1, 2)
        output = F.scaled_dot_product_attention(
            xq, keys, values, attn_mask=mask, enable_gqa=self.n_local_heads > self.n_local_kv_heads
        )  # (bsz, n_local_heads, seqlen, head_dim)
        # A position that sees no image attended evenly over tokens it must not see: its output is dropped.
        output = output * sees_image
        return self.wo(output.transpose(1, 2).reshape(bsz, seqlen, -1))


class CrossAttentionTransformerBlock(nn.Module):
    """Cross-attention and a feed-forward, each added through a learned tanh gate."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = CrossAttention(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.gate_attn = nn.Parameter(torch.zeros(1))
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.gate_ffwd = nn.Parameter(torch.zeros(1))

    def forward(
        self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sees_image: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.gate_attn.tanh() * self.attention(self.attention_norm(x), keys, values, mask, sees_image)
        ffn = self.feed_forward(self.ffn_norm(h)) * sees_image[:, 0]  # (bsz, seqlen, dim): none without an image
        return h + self.gate_ffwd.tanh() * ffn


class TextModel(Transformer):
    """`Transformer` with cross-attention blocks before the layers of `fusion_schedule`. The images of the batch it
    runs are `images` (`llama.vision.batch.BatchImages`), set for a batch and cleared after it; None: text only, no
    cross-attention, as Meta's code runs a batch without images."""

    def __init__(self, params: ModelArgs, vision: VisionArgs):
        super().__init__(params)
        self.learnable_embedding = VocabParallelEmbedding(LEARNABLE_EMBEDDINGS, params.dim, init_method=unused_init)
        schedule = fusion_schedule(params.n_layers, vision.cross_attention_layers)
        self.cross_attention_layers = nn.ModuleList(CrossAttentionTransformerBlock(params) for _ in schedule)
        self.cross_attention_before: Dict[int, int] = {layer: index for index, layer in enumerate(schedule)}
        self.images = None

    def show_images(self, images) -> None:
        """Set the images of the next batch (`llama.vision.batch.BatchImages`; None: text only)."""
        self.images = images

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, `<|image|>`'s from `learnable_embedding` (no branch on the tokens' values: a test
        of them would wait for the device at every step)."""
        h = self.tok_embeddings(tokens)
        image = self.learnable_embedding(torch.zeros_like(tokens[:1, :1])).type_as(h)  # (1, 1, dim)
        return torch.where((tokens == IMAGE_TOKEN_ID)[..., None], image, h)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, last_logits_only: bool = False) -> torch.Tensor:
        """`Transformer.forward`, with the images' cross-attention; with `last_logits_only`, the last position's
        logits only (the others are not needed to sample)."""
        seqlen = tokens.shape[1]
        h = self.embed(tokens)
        freqs_cis = self.rope_at(start_pos, seqlen, h.device)
        mask = causal_mask(seqlen, start_pos, h)
        images = self.images
        if images is not None:
            image_mask, sees_image = images.cross_attention_mask(start_pos, seqlen, h.dtype)
        for index, layer in enumerate(self.layers):
            if images is not None and index in self.cross_attention_before:
                block = self.cross_attention_before[index]
                keys, values = images.keys_values[block]
                h = self.cross_attention_layers[block](h, keys, values, image_mask, sees_image)
            h = layer(h, start_pos, freqs_cis, mask)
        if last_logits_only:
            h = h[:, -1:]
        return self.output(self.norm(h)).float()


class CrossAttentionTransformer(nn.Module):
    """Llama 3.2 Vision: `vision_model` makes an image's tokens, `text_model` reads them and the text."""

    def __init__(self, params: ModelArgs, vision: VisionArgs):
        super().__init__()
        self.params, self.vision = params, vision
        self.vocab_size = params.vocab_size
        self.vision_model = VisionModel(vision.encoder, params.dim)
        self.text_model = TextModel(params, vision)

    @property
    def tok_embeddings(self) -> VocabParallelEmbedding:
        return self.text_model.tok_embeddings

    def init_kv_caches(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        self.text_model.init_kv_caches(device, dtype)

    def show_images(self, images) -> None:
        """Set the images the text model's next batch sees (`llama.vision.batch.BatchImages`; None: text only)."""
        self.text_model.show_images(images)

    @torch.inference_mode()
    def image_tokens(self, tiles: torch.Tensor, tiles_high: int, tiles_wide: int) -> torch.Tensor:
        """The tokens of one image's tiles (from `llama.vision.images.image_tiles`), padded to MAX_TILES tiles with
        zeros as Meta's code pads them, for the text model: (MAX_TILES * tokens_per_tile, dim)."""
        weight = self.text_model.tok_embeddings.weight
        padded = torch.zeros(MAX_TILES, *tiles.shape[1:], dtype=weight.dtype, device=weight.device)
        padded[: tiles.shape[0]] = tiles
        return self.vision_model(padded, tiles_high, tiles_wide)
