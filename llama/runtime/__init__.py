"""The runtime, the one home of speed: what turns a loaded reference `Transformer` (`llama.model`) into the model that
runs here, and everything it runs on. `for_runtime` applies it, in named steps, once per `Llama.build`
(docs/internals.md walks them). One concern a module:
- `steps`: `for_runtime` and each of its steps, `quantize_model`, the compiled decode step;
- `transformer` and `attention`: `RuntimeTransformer` (the last position only, cache rows, the fixed-shape
  `decode_step`) and `RuntimeAttention` (the engine's cache writes); `cached_tokens`: which tokens each cache row
  holds;
- `kernel_table`: which kernel runs each product, by rule, from what the device offers, the weights and the row count;
- `parallel_layers`: the layers every device runs (`ParallelLinear`, `ParallelEmbedding`) and `KernelLinear`, whose
  product runs on the table's kernel;
- `cpu`: the CPU's float kernels and layers, and its quantized products; `quantized`: the quantized layers;
- `cuda_graphs` and `compiled`: the decode step replayed as CUDA graphs, or compiled by torch.compile;
- `vision`: `RuntimeVisionText`, a Llama 3.2 Vision model's text model, its images kept per cache row.

The names below are those the rest of the package uses; the tests and benchmarks reach the modules themselves.
"""

from llama.runtime.steps import compiled_step, for_runtime, quantize_model
from llama.runtime.transformer import DecodeStep, RuntimeTransformer

__all__ = ["DecodeStep", "RuntimeTransformer", "compiled_step", "for_runtime", "quantize_model"]
