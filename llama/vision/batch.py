"""A batch's images as the text model reads them: each image's keys and values in every cross-attention block,
computed once before decoding, and which text positions see which image.

Which positions see an image follows Meta's chat format (`create_vision_mask`): an image is seen from its
`<|image|>` token up to the next image's token, or, when images follow each other with nothing between, by all the
text after the last of them. A prompt's one image is seen by everything after it, the answer included; with two or
more, the last is seen up to the prompt's end, so the answer sees none (Meta's behaviour, kept).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from llama.vision.encoder import MAX_TILES
from llama.vision.images import image_tiles, open_image
from llama.vision.model import IMAGE_TOKEN_ID, CrossAttentionTransformer

# The most images one prompt may hold, a limit of this library's: each costs its keys and values in every
# cross-attention block, 200 MiB a sequence in 11B (docs/vision.md), and Meta's code sets none.
MAX_IMAGES = 4


def image_spans(tokens: Sequence[int]) -> List[Tuple[int, Optional[int]]]:
    """For each `<|image|>` in a prompt's `tokens`, the first position that sees the image and the position where
    that stops (None: never, the answer included)."""
    starts = [i for i, token in enumerate(tokens) if token == IMAGE_TOKEN_ID]
    if len(starts) == 1:
        return [(starts[0], None)]
    ends = starts[1:] + [len(tokens)]
    # From the last image back: an image directly followed by another is seen as far as that one is.
    for i in range(len(starts) - 2, -1, -1):
        if starts[i + 1] == starts[i] + 1:
            ends[i] = ends[i + 1]
    return list(zip(starts, ends))


# An image as the encoder takes it: its tiles and its grid (tiles high, tiles wide), from `image_tiles`.
ImageTiles = Tuple[torch.Tensor, Tuple[int, int]]


@dataclass
class BatchImages:
    """Images of a batch of prompts, every prompt's padded to the most any prompt has (`max_images`), each image to
    MAX_TILES tiles of `tokens_per_tile` tokens."""

    keys_values: List[Tuple[torch.Tensor, torch.Tensor]]  # per block, each (bsz, n_local_kv_heads, image tokens, hd)
    starts: torch.Tensor  # (bsz, max_images): the first position that sees each image
    ends: torch.Tensor  # (bsz, max_images): the position where that stops (a padding image: seen nowhere)
    tiles: torch.Tensor  # (bsz, max_images): the image's own tiles (the rest of MAX_TILES are padding)
    tokens_per_tile: int
    spans: List[List[Tuple[int, int]]]  # per prompt, (start, end) of its own images: `starts`, `ends` on the host

    def cross_attention_mask(
        self, start_pos: int, seqlen: int, dtype: torch.dtype
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """For positions [start_pos, start_pos + seqlen): the mask added to the cross-attention scores, (bsz, 1,
        seqlen, image tokens), 0 where a position sees an image token and the dtype's lowest value elsewhere; and
        `sees_image` (bsz, 1, seqlen, 1), 1 where a position sees some image token and 0 where it sees none. As in
        Meta's code, a position that sees none gets a mask of zeros (its output is dropped)."""
        positions = torch.arange(start_pos, start_pos + seqlen, device=self.starts.device)[None, :, None]
        sees = (self.starts[:, None, :] <= positions) & (positions < self.ends[:, None, :])  # (bsz, seqlen, images)
        own_tile = torch.arange(MAX_TILES, device=self.tiles.device) < self.tiles[..., None]  # (bsz, images, tiles)
        sees = sees[..., None] & own_tile[:, None]  # (bsz, seqlen, images, tiles)
        sees = sees.repeat_interleave(self.tokens_per_tile, dim=-1).flatten(2)[:, None]  # (bsz, 1, seqlen, tokens)
        sees_image = sees.any(dim=-1, keepdim=True).to(dtype)
        mask = torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(~sees, torch.finfo(dtype).min)
        return mask * sees_image, sees_image

    def row(self, i: int) -> "BatchImages":
        """Prompt i's images alone (views, padding included)."""
        return BatchImages(
            [(keys[i : i + 1], values[i : i + 1]) for keys, values in self.keys_values],
            self.starts[i : i + 1],
            self.ends[i : i + 1],
            self.tiles[i : i + 1],
            self.tokens_per_tile,
            [self.spans[i]],
        )

    def seen_by(self, start_pos: int, seqlen: int) -> bool:
        """Whether some position in [start_pos, start_pos + seqlen) of the first prompt sees one of its images."""
        end_pos = start_pos + seqlen
        return any(start < end_pos and start_pos < end for start, end in self.spans[0])


@torch.inference_mode()
def batch_images(
    model: CrossAttentionTransformer, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[ImageTiles]]
) -> Optional[BatchImages]:
    """Encode the images of a batch (`images[i]`: prompt i's, as `image_input` prepares them, in the order of its
    `<|image|>` tokens) and compute their keys and values in every cross-attention block; None when no prompt has
    an image.

    Raises:
        ValueError: when a prompt's `<|image|>` tokens and its images differ in number.
    """
    for i, (tokens, row) in enumerate(zip(prompts, images)):
        count = sum(1 for token in tokens if token == IMAGE_TOKEN_ID)
        if count != len(row):
            raise ValueError(f"Prompt {i} has {count} <|image|> tokens but {len(row)} images; give one per token")
    max_images = max(len(row) for row in images)
    if max_images == 0:
        return None
    text_model, encoder = model.text_model, model.vision.encoder
    image_len = MAX_TILES * encoder.tokens_per_tile
    bsz, device = len(prompts), text_model.tok_embeddings.weight.device
    starts = torch.zeros(bsz, max_images, dtype=torch.long)
    ends = torch.zeros(bsz, max_images, dtype=torch.long)  # padding images: seen from 0 to 0, by no position
    tiles = torch.zeros(bsz, max_images, dtype=torch.long)
    keys_values = []
    for block in text_model.cross_attention_layers:
        attention = block.attention
        shape = (2, bsz, attention.n_local_kv_heads, max_images * image_len, attention.head_dim)
        keys_values.append(torch.zeros(shape, dtype=text_model.tok_embeddings.weight.dtype, device=device))
    spans = []
    for i, (tokens, row) in enumerate(zip(prompts, images)):
        spans.append([])
        for j, ((its_tiles, (tiles_high, tiles_wide)), (start, end)) in enumerate(zip(row, image_spans(tokens))):
            tokens_of_image = model.image_tokens(its_tiles, tiles_high, tiles_wide)
            starts[i, j], ends[i, j] = start, model.params.max_seq_len if end is None else end
            spans[i].append((start, int(ends[i, j])))
            tiles[i, j] = tiles_high * tiles_wide
            for block, stacked in zip(text_model.cross_attention_layers, keys_values):
                stacked[:, i, :, j * image_len : (j + 1) * image_len] = block.attention.image_keys_values(
                    tokens_of_image
                )
    return BatchImages(
        [(kv[0], kv[1]) for kv in keys_values],
        starts.to(device),
        ends.to(device),
        tiles.to(device),
        encoder.tokens_per_tile,
        spans,
    )


def image_input(model: CrossAttentionTransformer, source) -> ImageTiles:
    """An image (a PIL image, an image file's bytes or a path) as `batch_images` takes it: opened and converted to
    RGB (`open_image`), then cut into tiles (`image_tiles`) in the vision model's dtype, as Meta's code prepares
    them in its default dtype, which its build sets to the model's.

    Raises:
        ValueError: for an image that cannot be read, or one too long and thin to tile
            (`llama.vision.images`); FileNotFoundError for a path with no file.
    """
    dtype = model.vision_model.vision_projection.weight.dtype
    return image_tiles(open_image(source), model.vision.encoder.tile_size, MAX_TILES, dtype)


def show_images(model, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[object]]) -> None:
    """Before a batch runs: give a vision model's text model the batch's images (each a PIL image, an image file's
    bytes or a path, in the order of its prompt's `<|image|>` tokens), or none for a batch of text only.

    Raises:
        ValueError: for an image given to a model without vision, more than `MAX_IMAGES` in one prompt, or an image
            that cannot be read (`llama.vision.images.open_image`).
    """
    if not isinstance(model, CrossAttentionTransformer):
        if any(images):
            raise ValueError(
                "This model takes no images: it is a text model. Images need a Llama 3.2 Vision checkpoint (11B, 90B)"
            )
        return
    model.show_images(None)  # first: a failure below leaves no earlier batch's images in place
    if not any(images):
        return
    for i, row in enumerate(images):
        if len(row) > MAX_IMAGES:
            raise ValueError(f"Prompt {i} has {len(row)} images; Llama 3.2 Vision takes at most {MAX_IMAGES} a prompt")
    prepared = [[image_input(model, image) for image in row] for row in images]
    model.show_images(batch_images(model, prompts, prepared))
