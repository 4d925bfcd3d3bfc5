"""The runtime, the one home of speed: what turns a loaded reference `Transformer` (`llama.model`) into the model that
runs here, and everything it runs on. `for_runtime` applies it, in named steps, once per `Llama.build`
(docs/internals.md walks them). One concern a module:
- `steps`: `for_runtime` and each of its steps, `quantize_model`, the compiled decode step;
- `transformer` and `attention`: `RuntimeTransformer` (the last position only, cache rows, the fixed-shape
  `decode_step`) and `RuntimeAttention` (fused projections, the engine's cache writes); `cached_tokens`: which tokens
  each cache row holds;
- `parallel_layers`: the layers every device runs (`ParallelLinear`, `ParallelEmbedding`) and `MeasuredLinear`, whose
  kernel per row count is chosen by measuring;
- `cpu`: the CPU's float kernels, their choice and the kernel cache; `quantized` and `quantized_kernels`: the
  quantized layers, their products and their choice; `stacked`: int8 layers of one input as one product on the CPU;
  `timing`: the timers every choice is made with;
- `cuda_graphs` and `compiled`: the decode step replayed as CUDA graphs, or compiled by torch.compile.

The names below are those the rest of the package uses; the tests and benchmarks reach the modules themselves.
"""

from llama.runtime.steps import compiled_step, for_runtime, quantize_model
from llama.runtime.transformer import DecodeStep, RuntimeTransformer

__all__ = ["DecodeStep", "RuntimeTransformer", "compiled_step", "for_runtime", "quantize_model"]
