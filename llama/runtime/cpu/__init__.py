"""CPU speed-up, applied at load: each linear layer's product on the kernel that runs it fastest on this CPU.

Which kernel is fastest depends on the CPU (AVX2 or AVX-512, bfloat16 instructions or not), the torch build, the
shape and the number of rows, so it is measured here rather than guessed from CPU flags: at load, for each product
shape and the row counts that matter (one row, the batch, a prompt), the kernels that keep the math
(`candidate_kernels`) are timed (`time_kernels`) and the one of the shortest median round is kept, but for a
float16 copy that would not repay the time to make it within one full context (`kernels_for`); what was measured
is cached per CPU, torch version and shape (`KernelCache`), so a later load does not measure again.
`LLAMA_CPU_KERNEL` pins one kernel.

Every kernel keeps the reference math: only the order in which the float32 products are summed changes, and on
float16 copies of weights that hold bfloat16 values (`pack_as_fp16`: bfloat16 weights, or float32 ones from a
bfloat16 checkpoint) the smallest weights round by less than 3e-8. Tests hold logits within 1e-4 of the reference
math in float32 and greedy tokens equal. Figures: `benchmarks/bench.py`, docs/speed.md.

One concern a module: `kernels` (what each kernel runs and needs), `layers` (`CPULinear`, `FusedProduct`), `cache`
(this CPU, and what measuring found on it), `choice` (measuring and choosing), `attention` (the kernel of one new
position's attention, measured likewise), `widened` (the quantized weights' products for a prompt's rows) and
`integer` (int8's product in integers on fbgemm), which `llama.runtime.quantized_kernels` chooses among.
`llama.runtime` applies them to a loaded model.
"""

from llama.runtime.cpu.attention import attention_kernel, matmul_attention_from
from llama.runtime.cpu.cache import (
    INSTRUCTION_CAPS,
    KernelCache,
    Measured,
    cpu_flags,
    cpu_name,
    cpuinfo_fields,
    instruction_caps,
    last_level_cache_bytes,
    measuring_alone,
)
from llama.runtime.cpu.choice import (
    DECODE_SAMPLE_VALUES,
    PROMPT_ROWS,
    PROMPT_SAMPLE_VALUES,
    PROMPT_TIMED_ROUNDS,
    TIMED_ROUNDS,
    choose_kernels,
    copies_that_fit,
    kernels_for,
    measure,
    row_counts,
    runs_on_cpu_kernels,
    time_kernels,
    weight_sample,
)
from llama.runtime.cpu.copies import calls_per_context
from llama.runtime.cpu.kernels import (
    ATTENTION_KERNELS,
    FP16_BLOCK_VALUES,
    FP16_MAX,
    KERNEL_VARIABLE,
    KERNELS,
    candidate_kernels,
    fbgemm_fp16_supported,
    fp16_linear,
    fp16_products,
    holds_bfloat16_values,
    one_position_attention,
    onednn_bf16_supported,
    onednn_supported,
    pack_as_fp16,
    pinned_kernel,
    run_kernel,
    unchanged,
    weight_copy,
    with_versions,
)
from llama.runtime.cpu.layers import (
    CPULinear,
    FusedProduct,
    FusedQKV,
    FusedW13,
    fused_product,
    layers_of,
    make_weight_copies,
    product_name,
    product_owners,
    products,
)

__all__ = [
    "ATTENTION_KERNELS",
    "CPULinear",
    "DECODE_SAMPLE_VALUES",
    "FP16_BLOCK_VALUES",
    "FP16_MAX",
    "FusedProduct",
    "FusedQKV",
    "FusedW13",
    "INSTRUCTION_CAPS",
    "KERNELS",
    "KERNEL_VARIABLE",
    "KernelCache",
    "Measured",
    "PROMPT_ROWS",
    "PROMPT_SAMPLE_VALUES",
    "PROMPT_TIMED_ROUNDS",
    "TIMED_ROUNDS",
    "attention_kernel",
    "calls_per_context",
    "candidate_kernels",
    "choose_kernels",
    "copies_that_fit",
    "runs_on_cpu_kernels",
    "cpu_flags",
    "cpu_name",
    "cpuinfo_fields",
    "fbgemm_fp16_supported",
    "fp16_linear",
    "fp16_products",
    "fused_product",
    "holds_bfloat16_values",
    "instruction_caps",
    "kernels_for",
    "last_level_cache_bytes",
    "layers_of",
    "make_weight_copies",
    "matmul_attention_from",
    "measure",
    "measuring_alone",
    "one_position_attention",
    "onednn_bf16_supported",
    "onednn_supported",
    "pack_as_fp16",
    "pinned_kernel",
    "product_name",
    "product_owners",
    "products",
    "row_counts",
    "run_kernel",
    "time_kernels",
    "unchanged",
    "weight_sample",
    "weight_copy",
    "with_versions",
]
