"""Llama 3.2 Vision's text model as it runs here: `RuntimeVisionText` is the text runtime
(`llama.runtime.RuntimeTransformer`: the kernel table's products, the last position only, cache rows, the decode step
of one token per row) with the cross-attention blocks run among its layers, and images kept per row of the KV cache.

Each cache row has the images of the prompt it holds (`RowImages`): `Llama.generate` shows a batch's images to rows
0, 1, ... (`show_images`), the server's engine one request's images to the row it runs in (`show_row_images`). A
cross-attention block then runs only the rows whose positions in the step see an image (the others pass through
unchanged, as in Meta's code, where a position that sees no image adds zeros), their projections and feed-forward
as one product and each row's attention over its own images' keys and values.

The tokens before a prompt's first `<|image|>` see no image, so their keys and values are those of a text model:
a cache row's may be reused for a later prompt up to there (`CachedTokensBeforeImages`), and not past it.
"""

import functools
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from llama.runtime.attention import AttentionKernel, MakeStack, masked_one_position_attention
from llama.runtime.cached_tokens import CachedTokens
from llama.runtime.transformer import RuntimeFeedForward, RuntimeTransformer
from llama.vision.batch import BatchImages, ImageTiles, batch_images, image_input
from llama.vision.model import IMAGE_TOKEN_ID, CrossAttentionTransformer, CrossAttentionTransformerBlock, TextModel

# A row's images as one block reads them for the positions of a step: (row in the batch, its images, the mask added
# to its scores (1, 1, seqlen, image tokens), 1 where a position sees an image and 0 where not (1, 1, seqlen, 1)).
SeenImages = Tuple[int, BatchImages, torch.Tensor, torch.Tensor]


class CachedTokensBeforeImages(CachedTokens):
    """`CachedTokens` whose rows are reusable up to a prompt's first `<|image|>` only: from there on, keys and values
    depend on the images, which the tokens do not name."""

    def reusable(self, row: int, prompt: Sequence[int]) -> int:
        first_image = next((i for i, token in enumerate(prompt) if token == IMAGE_TOKEN_ID), len(prompt))
        return min(super().reusable(row, prompt), first_image)


class RowImages:
    """The images each of `rows` cache rows sees (None: none), and, for the step running, which rows' positions see
    them (`seen`, worked out once a step and read by every block)."""

    def __init__(self, rows: int):
        self.rows: List[Optional[BatchImages]] = [None] * rows
        self.step: Optional[tuple] = None  # (the step's rows and positions, what `seen` found for them)

    def show(self, first_row: int, images: List[Optional[BatchImages]]) -> None:
        self.rows[first_row : first_row + len(images)] = images
        self.step = None

    def seen(
        self, first_row: int, bsz: int, start_pos: Union[int, torch.Tensor], seqlen: int, dtype: torch.dtype
    ) -> List[SeenImages]:
        """The rows [first_row, first_row + bsz), from `start_pos` (an int, one position as a tensor, or one per
        row), whose `seqlen` positions see an image, with their masks."""
        positions = start_pos.tolist() if isinstance(start_pos, torch.Tensor) else [start_pos]
        positions = positions * bsz if len(positions) == 1 else positions
        key = (first_row, bsz, tuple(positions), seqlen, dtype)
        if self.step is None or self.step[0] != key:
            found = []
            for b, position in enumerate(positions):
                images = self.rows[first_row + b]
                if images is not None and images.seen_by(position, seqlen):
                    found.append((b, images, *images.cross_attention_mask(position, seqlen, dtype)))
            self.step = (key, found)
        return self.step[1]


class RuntimeCrossAttentionBlock(nn.Module):
    """`CrossAttentionTransformerBlock` of the same modules and math, run on the rows of a step that see an image
    (see the module); it takes the arguments of a runtime layer, so that it runs among them."""

    def __init__(
        self, block: CrossAttentionTransformerBlock, index: int, images: RowImages, stack: Optional[MakeStack]
    ):
        super().__init__()
        self.index = index  # which block's keys and values it reads in each row's images
        self.attention = block.attention  # its `image_keys_values` makes the images' keys and values
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm
        self.gate_attn, self.gate_ffwd = block.gate_attn, block.gate_ffwd
        self.feed_forward = RuntimeFeedForward(block.feed_forward, stack)
        self.images = images

    def forward(
        self,
        x: torch.Tensor,
        start_pos: Union[int, torch.Tensor],
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
        last_position_only: bool = False,
        first_row: int = 0,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        seen = self.images.seen(first_row, bsz, start_pos, seqlen, x.dtype)
        if not seen:
            return x
        rows = [b for b, *_ in seen]
        picked = x if len(rows) == bsz else x[rows]  # (rows seeing an image, seqlen, dim)
        attention = self.attention
        xq = attention.wq(self.attention_norm(picked))
        xq = attention.q_norm(xq.view(len(rows), seqlen, attention.n_local_heads, attention.head_dim)).transpose(1, 2)
        outputs = []
        for j, (_, images, image_mask, sees_image) in enumerate(seen):
            keys, values = images.keys_values[self.index]
            if seqlen == 1:
                attended = masked_one_position_attention(xq[j : j + 1], keys, values, image_mask)
            else:
                gqa = attention.n_local_heads > attention.n_local_kv_heads
                attended = F.scaled_dot_product_attention(
                    xq[j : j + 1], keys, values, attn_mask=image_mask, enable_gqa=gqa
                )
            outputs.append(attended * sees_image)  # a position that sees no image: its output dropped, as in Meta's
        output = torch.cat(outputs).transpose(1, 2).reshape(len(rows), seqlen, -1)
        h = picked + self.gate_attn.tanh() * attention.wo(output)
        sees_image = torch.cat([sees for *_, sees in seen])[:, 0]  # (rows, seqlen, 1)
        h = h + self.gate_ffwd.tanh() * (self.feed_forward(self.ffn_norm(h)) * sees_image)
        if len(rows) == bsz:
            return h
        return x.index_copy(0, torch.tensor(rows, device=x.device), h)


class RuntimeVisionText(RuntimeTransformer):
    """A loaded Llama 3.2 Vision model's text model as the runtime runs it (see the module). On the model's vision
    encoder, `image_input(source)` prepares an image and `images_of(prompts, images)` encodes prepared ones
    (`llama.vision.batch`)."""

    embed = TextModel.embed  # `<|image|>` from `learnable_embedding`

    def __init__(
        self,
        model: CrossAttentionTransformer,
        one_position_attention: Optional[AttentionKernel] = None,
        stack: Optional[MakeStack] = None,
    ):
        text = model.text_model
        super().__init__(text, one_position_attention, stack)
        self.learnable_embedding = text.learnable_embedding
        self.images = RowImages(self.params.max_batch_size)
        self.cross_attention_layers = nn.ModuleList(
            RuntimeCrossAttentionBlock(block, index, self.images, stack)
            for index, block in enumerate(text.cross_attention_layers)
        )
        before = {layer: self.cross_attention_layers[index] for layer, index in text.cross_attention_before.items()}
        self.blocks = [block for i, layer in enumerate(self.layers) for block in (before.get(i), layer) if block]
        self.cached = CachedTokensBeforeImages(self.params.max_batch_size)
        # Not submodules: the encoder is not the runtime's.
        self.images_of = functools.partial(batch_images, model)
        self.image_input = functools.partial(image_input, model)

    def show_images(self, images: Optional[BatchImages]) -> None:
        """The images of `Llama.generate`'s next batch, prompt i's to row i (None: text only)."""
        rows = [] if images is None else [images.row(i) for i in range(len(images.spans))]
        self.images.show(0, rows + [None] * (len(self.images.rows) - len(rows)))

    def show_row_images(self, row: int, prompt: List[int], images: List[ImageTiles]) -> None:
        """Encode the images of the prompt that cache row `row` is to run (none: text only), for that row."""
        self.images.show(row, [None])  # first: a failure below leaves no earlier request's images in the row
        if images:
            self.images.show(row, [self.images_of([prompt], [images]).row(0)])
