"""The runtime: what turns a loaded reference `Transformer` (`llama.model`) into the model that runs here, and
the modules it runs on. `for_runtime` applies it, in named steps, once per `Llama.build`; docs/internals.md walks
them. One concern a module: `attention` (`RuntimeAttention`: fused projections, the fixed-shape step's and the
engine's cache writes, a faster kernel for one new position), `transformer` (`RuntimeTransformer`: the last
position only, cache rows, `decode_step`), `quantized_kernels` (a GPU's quantized products, timed) and `steps`
(`for_runtime` and each of its steps).
"""

from llama.runtime.attention import RuntimeAttention, apply_rotary_emb_per_row, write_at_positions, write_rows
from llama.runtime.quantized_kernels import choose_quantized_kernels, fastest
from llama.runtime.steps import (
    choose_cpu_kernels,
    compiled_decode_step,
    for_runtime,
    quantize_model,
    replace_layers,
    unpack_layers,
    use_cpu_kernels,
    use_cuda_graphs,
    use_parallel_layers,
)
from llama.runtime.transformer import DecodeStep, FusedFeedForward, RuntimeBlock, RuntimeTransformer

__all__ = [
    "DecodeStep",
    "FusedFeedForward",
    "RuntimeAttention",
    "RuntimeBlock",
    "RuntimeTransformer",
    "apply_rotary_emb_per_row",
    "choose_cpu_kernels",
    "choose_quantized_kernels",
    "compiled_decode_step",
    "fastest",
    "for_runtime",
    "quantize_model",
    "replace_layers",
    "unpack_layers",
    "use_cpu_kernels",
    "use_cuda_graphs",
    "use_parallel_layers",
    "write_at_positions",
    "write_rows",
]
