"""The eager decode step replayed as CUDA graphs: the default way to decode on one CUDA GPU.

An eager step launches a few hundred small kernels one by one from Python, and at batch 1 the GPU waits on the
launches more than on the weights. `RuntimeTransformer.decode_step` keeps every shape fixed from one step to the next
(the position is a tensor and attention runs over the whole cache, masked), so its kernels can be recorded once
as a CUDA graph and replayed with one launch. The replay runs the recorded kernels on the same inputs, so its
logits are those of the eager step bit for bit; nothing is compiled, and recording takes a fraction of a second.

One graph is recorded per batch size, on its first step; they share one memory pool. A graph reads the KV caches
and the RoPE table at the addresses it was recorded with, so it is recorded again when those are reallocated
(`init_kv_caches`).
"""

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import nn

from llama.model import ModelArgs


@dataclass
class RecordedStep:
    """One batch size's graph and the tensors it reads from and writes to."""

    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # (bsz, 1), copied in before each replay
    position: torch.Tensor  # (1,)
    logits: torch.Tensor  # (bsz, 1, vocab_size), written by each replay


def record(step: Callable[..., torch.Tensor], pool, *inputs: torch.Tensor) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Record `step(*inputs)` as a CUDA graph in memory `pool`; returns the graph and the output it writes.

    The step runs twice on a side stream first, so that what the first call of a kernel sets up (cuBLAS handles
    and workspaces, kernel choices) is done outside the recording. Those runs are real steps: they write the KV
    cache at the position in `inputs`, which the replay then writes again with the same values.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step(*inputs)
    return graph, output


class CUDAGraphDecodeStep:
    """A `DecodeStep` (see `llama.runtime`) that replays `model.decode_step` (a `RuntimeTransformer`'s) as a CUDA
    graph per batch size."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.steps: Dict[int, RecordedStep] = {}
        self.pool = None
        self.recorded_for: Tuple[int, ...] = ()

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        state = self.state_addresses()
        if state != self.recorded_for:  # caches or RoPE table reallocated: every graph reads stale memory
            self.steps.clear()
            self.recorded_for = state
        bsz = tokens.shape[0]
        recorded = self.steps.get(bsz)
        if recorded is None:
            recorded = self.steps[bsz] = self.record(tokens, position)
        else:
            recorded.tokens.copy_(tokens)
            recorded.position.copy_(position)
            recorded.graph.replay()
        # The next replay overwrites the graph's output; the caller gets logits of its own.
        return recorded.logits.clone()

    def record(self, tokens: torch.Tensor, position: torch.Tensor) -> RecordedStep:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_tokens, static_position = tokens.clone(), position.clone()
        graph, logits = record(self.model.decode_step, self.pool, static_tokens, static_position)
        graph.replay()  # recording ran nothing: this replay is the step
        return RecordedStep(graph, static_tokens, static_position, logits)

    def state_addresses(self) -> Tuple[int, ...]:
        """Where the tensors a graph reads besides its inputs and weights live now: every layer's KV cache and the
        RoPE table. Every layer counts: new caches may land where old ones were freed, so one layer's cache can be
        back at its recorded address while another's has moved."""
        caches = [layer.attention.kv_cache for layer in self.model.layers]
        cache_addresses = [tensor.data_ptr() for cache in caches for tensor in (cache.cache_k, cache.cache_v)]
        return (*cache_addresses, self.model.freqs_cis.data_ptr())


def decode_step_bytes(args: ModelArgs, model_parallel_size: int, dtype: torch.dtype) -> int:
    """A generous bound on the memory one decode step's activations hold at `args.max_batch_size` rows: what a
    recorded graph keeps in its pool. The largest are the logits (in `dtype`, then float32, plus the copy handed
    out) and the attention scores over the whole cache; the rest is a few vectors of the model's widths."""
    element = torch.empty(0, dtype=dtype).element_size()
    local_heads = args.n_heads // model_parallel_size
    widths = 4 * args.dim + 3 * args.ffn_hidden_dim // model_parallel_size + 2 * local_heads * args.head_dim
    per_row = (
        args.vocab_size * (element + 2 * 4)
        + 2 * local_heads * args.max_seq_len * 4  # scores (float32) and the mask made additive
        + 2 * widths * element
    )
    return args.max_batch_size * per_row
