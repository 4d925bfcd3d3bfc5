"""The CPU's kernels beyond `F.linear`, which the kernel table (`llama.runtime.kernel_table`) chooses among: one
concern a module. `kernels`: what the float kernels need (oneDNN, fbgemm's float16 copies) and one new position's
bfloat16 attention on float32 matmuls; `layers`: `CPULinear`, the float layers that run them; `widened`: the
quantized weights' products for a prompt's rows; `integer`: int8's product in integers on fbgemm.

Every kernel keeps the reference math: only the order in which the float32 products are summed changes, and on
float16 copies of weights that hold bfloat16 values (`kernels.pack_as_fp16`) the smallest weights round by less
than 3e-8. Tests hold logits within 1e-4 of the reference math in float32 and greedy tokens equal.
"""
