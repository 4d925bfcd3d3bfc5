"""Which kernel runs each linear product, by rule: a table from what the device offers, the weights' kind and the
row count of the call. Nothing is timed at load, so the same command gives the same kernels, and so the same sums,
on every run; the figures behind each row are in docs/speed.md ("The kernel table"), and
`python benchmarks/kernel_table.py` measures them again on the machine at hand.

What the CPU offers (`cpu_offers`) comes from PyTorch (`torch.backends.cpu.get_cpu_capability()`, which the
`ATEN_CPU_CAPABILITY` cap lowers, and whether oneDNN has bfloat16 kernels here, which `ONEDNN_MAX_CPU_ISA` lowers)
and from the CPU's flags (AMX, avx512_bf16, VNNI), for the load report. A CPU, weights or GPU the table does not know
runs PyTorch's own kernel: `F.linear`, and for quantized weights PyTorch's weight-only int8 or int4 kernel.

`LLAMA_CPU_KERNEL` pins one kernel for every CPU layer that has it, float or quantized (for tests and bisecting).
"""

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

# The row counts a kernel is chosen for: a call of n rows takes the first class whose bound is at least n. One row
# (a decode step of one sequence), a batch's decode step (or a speculative pass), a short prompt, a long one.
ROW_CLASSES = (1, 16, 127, None)
ROW_CLASS_NAMES = ("1 row", "2-16 rows", "17-127 rows", "128+ rows")

# What a CPU offers, as the table names it: AVX-512 with oneDNN's bfloat16 kernels (avx512_bf16 or AMX: Intel
# Xeons since Cooper Lake, AMD Zen 4 and Zen 5), or AVX2 (and AVX-512 CPUs capped to it).
AVX512_BF16, AVX2 = "AVX-512 with bfloat16", "AVX2"

# (what the CPU offers, the weights) -> the kernel for each row class. The weights: "bfloat16", "float32",
# "float32 holding bfloat16" (a float32 model loaded from a bfloat16 checkpoint: float16 holds its values
# exactly), "int8 <activations' dtype>", "int4". The kernels are `llama.runtime.cpu.layers.CPULinear`'s and
# `llama.runtime.quantized`'s.
CPU_TABLE: Dict[Tuple[str, str], Tuple[str, str, str, str]] = {
    (AVX512_BF16, "bfloat16"): ("onednn", "onednn", "onednn", "onednn"),
    (AVX512_BF16, "float32 holding bfloat16"): ("fp16", "fp16", "fp16", "fp16"),
    (AVX512_BF16, "float32"): ("onednn", "onednn", "onednn", "onednn"),
    (AVX512_BF16, "int8 bfloat16"): ("fbgemm_int8", "fbgemm_int8", "widened", "widened"),
    (AVX512_BF16, "int4"): ("int4pack", "int4pack", "int4pack", "widened"),
    (AVX2, "bfloat16"): ("fp16", "fp16", "fp16", "fp16"),
    (AVX2, "float32 holding bfloat16"): ("fp16", "fp16", "fp16", "fp16"),
    (AVX2, "int8 bfloat16"): ("fbgemm_int8", "fbgemm_int8", "widened32", "widened32"),
    (AVX2, "int4"): ("int4pack", "int4pack", "int4pack", "widened32"),
}

# One new position's bfloat16 attention runs on float32 matmuls (`llama.runtime.cpu.kernels.one_position_attention`)
# from this many cached positions on, SDPA's kernel below; on a CPU not listed, SDPA's at every length.
MATMUL_ATTENTION_FROM = {AVX512_BF16: 256, AVX2: 256}

# (CUDA compute capability's major number, the weights) -> the kernel for each row class: on an H100 (9.x).
CUDA_TABLE: Dict[Tuple[int, str], Tuple[str, str, str, str]] = {
    (9, "int8 bfloat16"): ("compiled", "widened", "widened", "widened"),
    (9, "int4"): ("int4pack", "int4pack", "dequantized", "dequantized"),
}

KERNEL_VARIABLE = "LLAMA_CPU_KERNEL"


@dataclass(frozen=True)
class CPUOffers:
    """What the CPU offers the kernels, as PyTorch sees it (capped by its environment variables) and as its flags
    say."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): "DEFAULT", "AVX2", "AVX512", ...
    onednn_bf16: bool  # oneDNN multiplies bfloat16 here (avx512_bf16, AMX or AVX-NE-CONVERT, and not capped)
    flags: Tuple[str, ...]  # of amx_bf16, avx512_bf16, avx512_vnni, avx_vnni: for the load report

    @property
    def kind(self) -> Optional[str]:
        """The table's name for this CPU, or None where the table does not know it."""
        if self.capability == "AVX512" and self.onednn_bf16:
            return AVX512_BF16
        return AVX2 if self.capability == "AVX2" else None

    def __str__(self) -> str:
        return f"{self.kind or 'a CPU the kernel table does not know'} ({self.capability}; {' '.join(self.flags)})"


@functools.cache
def cpu_offers() -> CPUOffers:
    """This CPU's `CPUOffers`, read once per process."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    onednn_bf16 = torch.backends.mkldnn.is_available() and check is not None and check()
    wanted = ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx_vnni")
    return CPUOffers(
        torch.backends.cpu.get_cpu_capability(), bool(onednn_bf16), tuple(f for f in wanted if f in cpu_flags())
    )


def cpu_flags() -> Tuple[str, ...]:
    """The first processor's flags in /proc/cpuinfo (none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return ()
    return tuple(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def row_class(rows: int) -> int:
    """The index in `ROW_CLASSES` of a call of `rows` rows."""
    return next(i for i, bound in enumerate(ROW_CLASSES) if bound is None or rows <= bound)


def pinned_kernel(known) -> Optional[str]:
    """The kernel `LLAMA_CPU_KERNEL` pins (None where it is unset or empty); a ValueError where it names none of
    `known`."""
    kernel = os.environ.get(KERNEL_VARIABLE, "").strip()
    if kernel and kernel not in known:
        raise ValueError(
            f"{KERNEL_VARIABLE}={kernel!r} is not a kernel: set one of {', '.join(sorted(known))}, or unset it"
        )
    return kernel or None


def table_kernels(device: torch.device, weights: str) -> Optional[Tuple[str, ...]]:
    """The table's kernel for each row class of `weights` on `device`, or None where the table has no row for them."""
    if device.type == "cpu":
        return CPU_TABLE.get((cpu_offers().kind, weights))
    if device.type == "cuda":
        return CUDA_TABLE.get((torch.cuda.get_device_capability(device)[0], weights))
    return None


def matmul_attention_from() -> Optional[int]:
    """The cached positions from which one new position's bfloat16 attention runs on float32 matmuls on this CPU, or
    None (SDPA's kernel at every length)."""
    return MATMUL_ATTENTION_FROM.get(cpu_offers().kind)
