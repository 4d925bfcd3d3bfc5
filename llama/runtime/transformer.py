"""The Transformer as it runs here: `RuntimeTransformer` holds a loaded reference `Transformer`'s modules (the same
weights under the same state-dict keys) and adds what decoding needs beyond `Transformer.forward`:
- `forward(..., last_logits_only=True)`: the last layer's feed-forward and the output head skip every position but
  the last, since sampling needs only the next token's distribution;
- `forward(..., first_row=r)`: a batch held in the cache's rows from r on (the engine runs a request in its row);
- `decode_step`: one new token per row in shapes that never change, for torch.compile and CUDA graphs;
- `cached`: the tokens each cache row holds (`CachedTokens`), for prefix reuse, and `copy_cached` between rows.
"""

from typing import Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from llama.model import FeedForward, Transformer, TransformerBlock, causal_mask
from llama.runtime.attention import AttentionKernel, MakeStack, RuntimeAttention
from llama.runtime.cached_tokens import CachedTokens

# A one-token step: (tokens (bsz, 1), position as a one-element tensor, or one per row) -> logits (bsz, 1, vocab_size).
DecodeStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RuntimeFeedForward(nn.Module):
    """`FeedForward` of the same layers, with w1 and w3 run as one product where they are stacked (`w13`)."""

    def __init__(self, feed_forward: FeedForward, stack: Optional[MakeStack]):
        super().__init__()
        self.w1, self.w2, self.w3 = feed_forward.w1, feed_forward.w2, feed_forward.w3
        self.w13 = stack(self.w1, self.w3) if stack else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x) if self.w13 is not None else (self.w1(x), self.w3(x))
        return self.w2(F.silu(gate) * up)


class RuntimeBlock(nn.Module):
    """`TransformerBlock` over `RuntimeAttention`, whose positions may be a tensor and whose batch may sit in rows
    of the cache from `first_row` on, and `RuntimeFeedForward`."""

    def __init__(
        self, block: TransformerBlock, one_position_attention: Optional[AttentionKernel], stack: Optional[MakeStack]
    ):
        super().__init__()
        self.layer_id = block.layer_id
        self.attention = RuntimeAttention(block.attention, one_position_attention, stack)
        self.feed_forward = RuntimeFeedForward(block.feed_forward, stack)
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm

    def forward(
        self,
        x: torch.Tensor,
        start_pos: Union[int, torch.Tensor],
        freqs_cis: torch.Tensor,
        mask: Optional[torch.Tensor],
        last_position_only: bool = False,
        first_row: int = 0,
    ) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), start_pos, freqs_cis, mask, first_row)
        if last_position_only:  # every position's keys and values are cached now; only the last output is wanted
            x, attended = x[:, -1:], attended[:, -1:]
        h = x + attended
        return h + self.feed_forward(self.ffn_norm(h))


class RuntimeTransformer(Transformer):
    """A loaded `Transformer`'s modules, run as decoding needs them (see the module). `llama.runtime.for_runtime`
    builds it; `one_position_attention` is a faster kernel for one new position's attention, where the device has
    one. It is a `Transformer` (the RoPE table and the caches are made as the reference makes them) whose blocks are
    `RuntimeBlock`s, built from a loaded model's modules rather than from `ModelArgs`; `stack` (if any) runs each
    block's layers of one input as one product where it can."""

    def __init__(
        self,
        model: Transformer,
        one_position_attention: Optional[AttentionKernel] = None,
        stack: Optional[MakeStack] = None,
    ):
        nn.Module.__init__(self)  # not Transformer's: the modules are the loaded model's own
        self.params, self.vocab_size, self.n_layers = model.params, model.vocab_size, model.n_layers
        self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleList(RuntimeBlock(block, one_position_attention, stack) for block in model.layers)
        # What each position runs through, in order: the layers (a vision model's cross-attention blocks among them).
        self.blocks: List[nn.Module] = list(self.layers)
        self.norm = model.norm
        self.output = model.output
        self.freqs_cis = model.freqs_cis
        self.cached = CachedTokens(self.params.max_batch_size)
        self.kernels_in_use: Optional[str] = None  # the kernels its layers run on, once `for_runtime` has chosen them

    def init_kv_caches(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        """`Transformer.init_kv_caches`: zeroed caches, which hold no tokens."""
        super().init_kv_caches(device, dtype)
        self.cached.forget()

    def copy_cached(self, source: int, target: int, start: int, end: int) -> None:
        """Copy the keys and values of positions [start, end) from cache row `source` to row `target`, in every
        layer, where both rows hold the same tokens before `start`: the tokens that follow, without running them
        through the model again."""
        self.cached.keep(target, start)  # overwritten from start on, even if this fails
        for layer in self.layers:
            cache = layer.attention.kv_cache
            cache.cache_k[target, start:end] = cache.cache_k[source, start:end]
            cache.cache_v[target, start:end] = cache.cache_v[source, start:end]
        self.cached.wrote(target, start, self.cached[source][start:end])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start_pos: int, last_logits_only: bool = False, first_row: int = 0
    ) -> torch.Tensor:
        """`Transformer.forward`; with `last_logits_only`, the logits of the last position only; the batch in the
        cache's rows [first_row, first_row + bsz)."""
        seqlen = tokens.shape[1]
        written = tokens.tolist()
        for row in range(first_row, first_row + len(written)):  # overwritten from start_pos on, even on failure
            self.cached.keep(row, start_pos)
        h = self.embed(tokens)
        freqs_cis = self.rope_at(start_pos, seqlen, h.device)
        mask = causal_mask(seqlen, start_pos, h)
        for layer in self.blocks:
            last_only = last_logits_only and layer is self.layers[-1]
            h = layer(h, start_pos, freqs_cis, mask, last_only, first_row)
        for row, row_tokens in enumerate(written, start=first_row):
            self.cached.wrote(row, start_pos, row_tokens)
        return self.output(self.norm(h)).float()

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """`forward(tokens, start_pos)` for one new token per row, in shapes that stay the same at every step.

        `position` is start_pos as a one-element tensor, and attention runs over the cache with the positions after it
        masked out (`attended_positions`: the whole cache, so that one compiled step or CUDA graph serves them all).
        With bsz positions instead, each row is at its own (a batch whose requests started at different times,
        `llama.serve.engine`). The RoPE table must exist: `init_kv_caches` or a first `forward` made it. It may run
        compiled or as a CUDA graph, so it does not record what it writes in `cached`: its callers do.
        """
        h = self.embed(tokens)  # (bsz, 1, dim)
        cache_positions = torch.arange(self.attended_positions(position), device=tokens.device)
        mask = cache_positions[None, :] <= position[:, None]  # (1 or bsz, positions): the positions written
        freqs_cis = self.freqs_cis[position]  # (1 or bsz, head_dim // 2)
        if len(position) > 1:
            mask = mask[:, None, None, :]  # (bsz, 1, 1, positions): each row's own, for every head
        for layer in self.blocks:
            h = layer(h, position, freqs_cis, mask)
        return self.output(self.norm(h)).float()

    def attended_positions(self, position: torch.Tensor) -> int:
        """How many of the cache's positions a decode step at `position` attends over: in a fixed-shape step (compiled,
        or recorded as a CUDA graph) the whole cache, the positions not yet written masked out; eagerly on the CPU only
        those up to the furthest row's position, as the reference reads its cache, so that the cache's size
        (`max_seq_len`) does not change the sums."""
        eager_on_cpu = position.device.type == "cpu" and not torch.compiler.is_compiling()
        return int(position.max()) + 1 if eager_on_cpu else self.params.max_seq_len
