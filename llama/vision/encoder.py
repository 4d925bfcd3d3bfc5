"""The vision encoder of Llama 3.2 Vision: a ViT that turns an image's tiles into features for the text model.

An image arrives as up to four tiles of `vision_chunk_size` pixels (`llama.vision.images`). Each tile is cut into
14x14 patches, one token each, plus a class token; a learned position embedding says where a token sits in its
tile, and tile-position embeddings say where the tile sits in the image. A first transformer (32 layers) reads
the tiles; a second, "global" one (8 gated layers) reads them again after a second tile embedding. The features
given to the text model are the last layer's output beside the outputs of five earlier layers (7,680 per token at
Meta's width of 1,280). Module names are Meta's checkpoint keys, and every layer is split over model-parallel
processes as Meta's code splits it (fairscale's layers).
"""

from dataclasses import dataclass
from typing import List, Tuple

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import nn

# Tile positions the tile embeddings hold: an image is at most 4 tiles, in any arrangement of up to 4 x 4.
MAX_TILES = 4


@dataclass
class EncoderArgs:
    """The encoder's sizes. Meta's are fixed in its code (these defaults); a params.json may set smaller ones with
    this library's own `vision_encoder_*` fields, for tests and demos."""

    tile_size: int  # a tile's side in pixels (params.json's vision_chunk_size: 560 for Llama 3.2 Vision)
    width: int = 1280
    layers: int = 32
    heads: int = 16
    global_layers: int = 8
    intermediate_layers: Tuple[int, ...] = (3, 7, 15, 23, 30)  # whose inputs join the features
    patch_size: int = 14

    def __post_init__(self):
        if self.tile_size % self.patch_size:
            raise ValueError(f"vision_chunk_size ({self.tile_size}) must be a multiple of the patch size (14)")
        if self.width % self.heads:
            raise ValueError(f"The encoder width ({self.width}) must be divisible by its heads ({self.heads})")
        if any(not 0 <= i < self.layers for i in self.intermediate_layers):
            raise ValueError(f"Intermediate layers {self.intermediate_layers} must lie in [0, {self.layers})")
        if len(set(self.intermediate_layers)) != len(self.intermediate_layers):
            raise ValueError(f"Intermediate layers {self.intermediate_layers} must each be named once")

    @property
    def tokens_per_tile(self) -> int:
        """The patches of a tile and its class token."""
        return (self.tile_size // self.patch_size) ** 2 + 1

    @property
    def feature_dim(self) -> int:
        """The width of a token's features: the last layer's output and each intermediate one."""
        return self.width * (len(self.intermediate_layers) + 1)


def unused_init(weight: torch.Tensor) -> torch.Tensor:
    """fairscale's init_method: none, as every weight comes from the checkpoint."""
    return weight


class TilePatches(nn.Module):
    """A tile's 14x14 patches, each flattened and projected to the encoder's width: a strided convolution written
    as unfold and a linear layer, whose output columns are split over model-parallel processes."""

    def __init__(self, in_channels: int, width: int, patch_size: int):
        super().__init__()
        self._unfold = nn.Unfold(kernel_size=patch_size, stride=patch_size)
        self._linear = ColumnParallelLinear(
            in_channels * patch_size * patch_size, width, bias=False, init_method=unused_init
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._unfold(x).permute(0, 2, 1)  # (tiles, patches, channels * patch_size ** 2)
        return self._linear(x)  # (tiles, patches, width), gathered from every process


class ImageAttention(nn.Module):
    """Multi-head attention over all tokens of an image's tiles (no RoPE, no cache, no causal mask)."""

    def __init__(self, width: int, n_heads: int):
        super().__init__()
        model_parallel_size = fs_init.get_model_parallel_world_size()
        self.n_local_heads = n_heads // model_parallel_size
        self.head_dim = width // n_heads
        self.wq = ColumnParallelLinear(width, width, bias=False, gather_output=False, init_method=unused_init)
        self.wk = ColumnParallelLinear(width, width, bias=False, gather_output=False, init_method=unused_init)
        self.wv = ColumnParallelLinear(width, width, bias=False, gather_output=False, init_method=unused_init)
        self.wo = RowParallelLinear(width, width, bias=False, input_is_parallel=True, init_method=unused_init)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = [
            w(x).view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        ]  # each (bsz, n_local_heads, seqlen, head_dim)
        output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask)
        return self.wo(output.transpose(1, 2).reshape(bsz, seqlen, -1))


class ImageFeedForward(nn.Module):
    """Two linear layers with biases around an exact GELU."""

    def __init__(self, width: int, hidden_dim: int):
        super().__init__()
        self.c_fc = ColumnParallelLinear(width, hidden_dim, bias=True, gather_output=False, init_method=unused_init)
        self.c_proj = RowParallelLinear(hidden_dim, width, bias=True, input_is_parallel=True, init_method=unused_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class ImageTransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block; in the global transformer both branches pass through tanh gates."""

    def __init__(self, width: int, n_heads: int, gated: bool):
        super().__init__()
        self.attn = ImageAttention(width, n_heads)
        self.ln_1 = nn.LayerNorm(width)
        self.mlp = ImageFeedForward(width, 4 * width)
        self.ln_2 = nn.LayerNorm(width)
        self.gated = gated
        if gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = self.attn(self.ln_1(x), mask)
        x = x + (self.gate_attn.tanh() * attn if self.gated else attn)
        ffn = self.mlp(self.ln_2(x))
        return x + (self.gate_ffn.tanh() * ffn if self.gated else ffn)


class ImageTransformer(nn.Module):
    def __init__(self, width: int, layers: int, n_heads: int, gated: bool = False):
        super().__init__()
        self.resblocks = nn.ModuleList([ImageTransformerBlock(width, n_heads, gated) for _ in range(layers)])

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, keep: Tuple[int, ...] = ()
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The output, and the inputs of the layers in `keep`."""
        kept = []
        for index, block in enumerate(self.resblocks):
            if index in keep:
                kept.append(x)
            x = block(x, mask)
        return x, kept


class TilePositionEmbedding(nn.Module):
    """A learned vector per tile position (row, column) of the image's canvas, added to every token of the tile."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.embedding = nn.Parameter(torch.zeros(MAX_TILES, MAX_TILES, 1, width))
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, tiles_high: int, tiles_wide: int) -> torch.Tensor:
        """`x` (tiles, tokens, width): one image's tiles, row-major, padded to MAX_TILES."""
        used = tiles_high * tiles_wide
        embedding = torch.zeros(x.shape[0], 1, self.width, device=x.device, dtype=x.dtype)  # padding tiles: none
        embedding[:used] = self.embedding[:tiles_high, :tiles_wide].reshape(used, 1, self.width)
        return x + embedding * self.gate.tanh()


class VisionEncoder(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        width, tokens = args.width, args.tokens_per_tile
        self.conv1 = TilePatches(3, width, args.patch_size)
        self.class_embedding = nn.Parameter(torch.zeros(width))
        self.positional_embedding = nn.Parameter(torch.zeros(tokens, width))
        # A position embedding per token of each tile position, blended with the one above by a gate.
        self.gated_positional_embedding = nn.Parameter(torch.zeros(MAX_TILES, MAX_TILES, tokens, width))
        self.gated_positional_embedding_gate = nn.Parameter(torch.zeros(1))
        self.ln_pre = nn.LayerNorm(width)
        self.ln_post = nn.LayerNorm(width)
        self.transformer = ImageTransformer(width, args.layers, args.heads)
        self.global_transformer = ImageTransformer(width, args.global_layers, args.heads, gated=True)
        self.pre_tile_pos_embed = TilePositionEmbedding(width)
        self.post_tile_pos_embed = TilePositionEmbedding(width)

    def forward(self, tiles: torch.Tensor, tiles_high: int, tiles_wide: int) -> torch.Tensor:
        """The features of one image's tokens, (MAX_TILES, tokens_per_tile, feature_dim), from its tiles
        (MAX_TILES, 3, tile_size, tile_size): the image's own, row-major, then black padding tiles.

        The padding tiles run through the encoder too, as in Meta's code, and the image's tokens attend to them:
        their features differ if they are left out."""
        width, tokens = self.args.width, self.args.tokens_per_tile
        used = tiles_high * tiles_wide
        x = self.conv1(tiles)  # (MAX_TILES, tokens - 1, width)
        x = self.pre_tile_pos_embed(x, tiles_high, tiles_wide)
        class_tokens = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, width)
        x = torch.cat([class_tokens, x], dim=1)  # (MAX_TILES, tokens, width)
        gate = self.gated_positional_embedding_gate.tanh()
        x = x + self.positional_embedding * (1 - gate)
        tile_positions = self.gated_positional_embedding[:tiles_high, :tiles_wide].reshape(used, tokens, width)
        x[:used] += tile_positions * gate
        x = self.ln_pre(x)

        # Each tile padded to a multiple of 8 tokens (8 more where it already is one, as in Meta's code).
        padded = tokens + 8 - tokens % 8
        x = F.pad(x, (0, 0, 0, padded - tokens))  # (MAX_TILES, padded, width)
        mask = padding_mask(used, tokens, padded, x.dtype, x.device)
        x, kept = self.transformer(x.view(1, MAX_TILES * padded, width), mask, self.args.intermediate_layers)
        x = self.ln_post(x)
        x = self.post_tile_pos_embed(x.view(MAX_TILES, padded, width), tiles_high, tiles_wide)
        x, _ = self.global_transformer(x.view(1, MAX_TILES * padded, width), mask)
        # Meta's order of the features: the last output's, then the kept ones interleaved, feature by feature.
        kept = torch.stack(kept, dim=-1).view(MAX_TILES, padded, -1)
        features = torch.cat([x.view(MAX_TILES, padded, width), kept], dim=-1)
        return features[:, :tokens]  # (MAX_TILES, tokens, feature_dim)


def padding_mask(used: int, tokens: int, padded: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The encoder's attention mask, added to the scores, as Meta's code builds it: a padding token (of a padding
    tile, or past a tile's `tokens`) does not attend to another padding token; every other pair attends."""
    is_padding = torch.ones(MAX_TILES, padded, dtype=dtype, device=device)
    is_padding[:used, :tokens] = 0
    is_padding = is_padding.view(-1, 1)
    return (is_padding @ is_padding.T * torch.finfo(dtype).min).view(1, 1, MAX_TILES * padded, MAX_TILES * padded)


class VisionModel(nn.Module):
    """The encoder and the projection of its features to the text model's width."""

    def __init__(self, args: EncoderArgs, text_dim: int):
        super().__init__()
        self.vision_encoder = VisionEncoder(args)
        self.vision_projection = ColumnParallelLinear(args.feature_dim, text_dim, bias=True, init_method=unused_init)

    def forward(self, tiles: torch.Tensor, tiles_high: int, tiles_wide: int) -> torch.Tensor:
        """One image's tokens for the text model's cross-attention, (MAX_TILES * tokens_per_tile, text dim)."""
        features = self.vision_encoder(tiles, tiles_high, tiles_wide)
        return self.vision_projection(features).flatten(0, 1)
