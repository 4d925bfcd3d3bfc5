"""Which kernel runs each product, measured at load (`choose_kernels`) and cached per CPU, torch version and shape
(`KernelCache`); `speed_up_for_cpu` applies it all to a loaded model."""

import json
import logging
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from llama.cpu.kernels import (
    KERNEL_VARIABLE,
    KERNELS,
    candidate_kernels,
    fbgemm_fp16_supported,
    fp16_linear,
    holds_bfloat16_values,
    one_position_attention,
    onednn_bf16_supported,
    onednn_supported,
    pack_as_fp16,
    pinned_kernel,
    run_kernel,
)
from llama.cpu.layers import (
    CPULinear,
    fuse_fp16_products,
    make_fp16_copies,
    product_name,
    products,
    use_cpu_linear_layers,
)
from llama.distributed import available_memory

logger = logging.getLogger(__name__)

PROMPT_ROWS = 256  # the row count a prompt is measured at; inputs of more rows than the batch use its choice
DECODE_SAMPLE_VALUES = 2**22  # one row and the batch: timed on up to this many weights of a product (from memory)
PROMPT_SAMPLE_VALUES = 2**20  # a prompt: fewer, since it is bound by arithmetic rather than by reading the weight
TIMED_ROUNDS = 2  # after a warm-up round; each kernel keeps its best round


def last_level_cache_bytes() -> int:
    """The size of the CPU's largest data cache (Linux's sysfs), or 32 MiB where it is not known."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip().upper()
                sizes.append(int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]] if size[-1] in "KM" else int(size))
        except (OSError, ValueError):
            continue
    return min(max(sizes, default=32 * 2**20), 512 * 2**20)


def time_kernels(runs: Dict[str, Callable[[], object]], flush: Optional[Callable[[], object]]) -> Dict[str, float]:
    """Each kernel's best time in seconds over `TIMED_ROUNDS` rounds, after a warm-up round (where oneDNN builds
    its primitives and mapped weights are read in). The kernels take turns within a round, so that a slow spell
    of a shared machine falls on all of them. Each round starts with `flush` (if any), which evicts the caches,
    since in a decode step each weight comes from memory, the rest of the model having been read since; each
    kernel runs on its own copy of the weights, so one kernel's call does not bring the next one's weights into
    the cache. A kernel more than twice as slow as the best after a round is not timed again."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, math.inf)
    timed = list(runs)
    for _ in range(TIMED_ROUNDS):
        if flush is not None:
            flush()
        for kernel in timed:
            start = time.perf_counter()
            runs[kernel]()
            best[kernel] = min(best[kernel], time.perf_counter() - start)
        timed = [kernel for kernel in timed if best[kernel] <= 2 * min(best.values())]
    return best


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where Linux gives them (a virtual machine may name
    only the vendor's line, "AMD EPYC")."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    numbers = [f"{key} {fields[key]}" for key in ("cpu family", "model") if key in fields]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def cpu_flags() -> List[str]:
    """Which of the instruction sets that decide the kernels' speed this CPU has."""
    flags = set(cpuinfo_fields().get("flags", "").split())
    wanted = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    found = [flag for flag in wanted if flag in flags]
    return found or [f"torch: {torch.backends.cpu.get_cpu_capability()}"]


def cpuinfo_fields() -> Dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines()))


class KernelCache:
    """The kernels chosen here, in `$XDG_CACHE_HOME/llama3/kernels.json` (or ~/.cache/llama3/kernels.json), keyed
    by the CPU, its flags, the torch version, the thread count, the product and the rows: a later load on the same
    CPU with the same torch takes them without measuring. A file that cannot be read, or holds anything else, is
    ignored (the kernels are measured again and the file rewritten); one that cannot be written is skipped."""

    FORMAT = 1

    def __init__(self):
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        self.path = Path(root) / "llama3" / "kernels.json"
        self.machine = (
            f"{cpu_name()} [{' '.join(cpu_flags())}], torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        self.choices = self.read()
        self.measured = {}

    def read(self) -> Dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("Ignoring the CPU kernel cache %s, which cannot be read (%s): measuring again", self.path, e)
            return {}
        choices = data.get("choices") if isinstance(data, dict) and data.get("format") == self.FORMAT else None
        if not isinstance(choices, dict) or not all(kernel in KERNELS for kernel in choices.values()):
            logger.warning("Ignoring the CPU kernel cache %s, which holds something else: measuring again", self.path)
            return {}
        return choices

    def key(self, product: str, rows: int, candidates: List[str]) -> str:
        return f"{self.machine} | {product} | {rows} rows | {' '.join(candidates)}"

    def get(self, key: str) -> Optional[str]:
        return self.choices.get(key)

    def put(self, key: str, kernel: str) -> None:
        self.choices[key] = self.measured[key] = kernel

    def save(self) -> None:
        """Write the kernels measured since this cache was read, with what the file holds now (another process may
        have added its own), replacing the file in one step."""
        if not self.measured:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"format": self.FORMAT, "choices": {**self.read(), **self.measured}}, indent=1)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as file:
                file.write(text)
            os.replace(file.name, self.path)
        except OSError as e:
            logger.warning("Could not write the CPU kernel cache %s (%s): the next load measures again", self.path, e)


def row_counts(max_batch_size: int) -> List[int]:
    """The row counts kernels are chosen for: one row (a decode step of one sequence), the batch, a prompt."""
    return [1] + ([max_batch_size] if 1 < max_batch_size < PROMPT_ROWS else []) + [PROMPT_ROWS]


def weight_sample(layers: List[CPULinear], max_values: int, part: int = 0) -> Optional[List[torch.Tensor]]:
    """Each layer's weight, or where the product holds more than `max_values` weights, rows of it in proportion:
    the `part`-th such share of its rows (0: the first rows), or None where the weights have no such part."""
    total = sum(layer.weight.numel() for layer in layers)
    if total <= max_values:
        return [layer.weight.detach() for layer in layers] if part == 0 else None
    shares = [max(1, layer.weight.shape[0] * max_values // total) for layer in layers]
    if any((part + 1) * share > layer.weight.shape[0] for share, layer in zip(shares, layers)):
        return None
    return [layer.weight.detach()[part * share : (part + 1) * share] for share, layer in zip(shares, layers)]


def sample_copy(kernel: str, layers: List[CPULinear], max_values: int, part: int) -> Optional[List[torch.Tensor]]:
    """The weights `kernel` runs on in a measurement, in memory of its own (see `time_kernels`): the stacked float16
    copy of the sample for "fp16" (None where float16 cannot hold it), a copy in oneDNN's layout for "onednn" in
    bfloat16; else the weights' `part`-th sample as they are, or a copy of the first where they have no such part."""
    weights = weight_sample(layers, max_values)
    if kernel == "fp16":
        copy = pack_as_fp16(*weights)
        return None if copy is None else [copy]
    if kernel == "onednn" and weights[0].dtype != torch.float32:
        return [torch.ops.mkldnn._reorder_linear_weight(weight) for weight in weights]
    return weight_sample(layers, max_values, part) or [weight.clone() for weight in weights]


def measure(
    layers: List[CPULinear], rows: int, candidates: List[str], flush, copies: Optional[dict] = None
) -> Dict[str, float]:
    """The best seconds of each candidate kernel for `rows` rows through the product of `layers` (`time_kernels`),
    on a sample of its weights (`weight_sample`), each kernel on weights in memory of its own (`sample_copy`), kept
    in `copies` for the product's other row counts. One row and the batch are timed with the caches flushed
    before each round (as a decode step meets its weights); a prompt, bound by arithmetic, without."""
    decode = rows < PROMPT_ROWS
    sample_values = DECODE_SAMPLE_VALUES if decode else PROMPT_SAMPLE_VALUES
    copies = {} if copies is None else copies
    x = torch.randn(rows, layers[0].weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(layers[0].weight.dtype)
    runs = {}
    for part, kernel in enumerate(candidates):
        if (kernel, sample_values) not in copies:
            copies[kernel, sample_values] = sample_copy(kernel, layers, sample_values, part)
        copy = copies[kernel, sample_values]
        if kernel == "fp16" and copy is not None:  # one product of the stacked weights, as a fused group runs
            runs[kernel] = lambda packed=copy[0]: fp16_linear(x, packed)
        elif copy is not None:
            runs[kernel] = lambda kernel=kernel, copy=copy: [run_kernel(kernel, x, weight, None) for weight in copy]
    return time_kernels(runs, flush if decode else None)


def choose_kernels(model: nn.Module, counts: List[int], copies: bool) -> None:
    """Set each `CPULinear`'s kernels for `counts` rows: pinned by `LLAMA_CPU_KERNEL` (where that kernel can run
    the product: else `F.linear`), or the fastest of `candidate_kernels`, from the cache or measured here, once
    per product name; each choice is logged."""
    pinned = pinned_kernel()
    cache = KernelCache()
    flush_buffer = None
    chosen = {}
    start = time.perf_counter()
    with torch.no_grad():
        for layers in products(model):
            name = product_name(layers)
            if name not in chosen:
                fp16_holds = all(holds_bfloat16_values(layer.weight) for layer in layers)
                chosen[name] = {}
                measured_copies = {}  # each kernel's copy of the sample, shared by the product's row counts
                for rows in counts:
                    candidates = candidate_kernels(layers[0].weight.dtype, rows, fp16_holds, copies)
                    key = cache.key(name, rows, candidates)
                    if pinned is not None:
                        kernel = pinned if pinned in candidates else "linear"
                        how = f"pinned by {KERNEL_VARIABLE}={pinned}"
                    elif len(candidates) == 1:
                        kernel, how = candidates[0], "the only candidate"
                    elif cache.get(key) is not None:
                        kernel, how = cache.get(key), f"from {cache.path}"
                    else:
                        if flush_buffer is None:
                            flush_buffer = torch.ones(last_level_cache_bytes() // 4)
                        times = measure(layers, rows, candidates, flush_buffer.sum, measured_copies)
                        kernel = min(times, key=times.get)
                        cache.put(key, kernel)
                        how = "measured: " + ", ".join(
                            f"{k} {t * 1e3:.3g} ms" for k, t in times.items() if t < math.inf
                        )
                    chosen[name][rows] = kernel
                    logger.info("CPU kernel for %s, %d rows: %s (%s)", name, rows, kernel, how)
            for layer in layers:
                layer.kernels = dict(chosen[name])
    cache.save()
    logger.info(
        "CPU kernels chosen for %d products in %.2f s (%d row counts measured)",
        len(chosen),
        time.perf_counter() - start,
        len(cache.measured),
    )


def speed_up_for_cpu(model: nn.Module) -> None:
    """Put each linear layer of a loaded `Transformer` (model-parallel layers still fairscale's) on the kernel that
    runs it fastest here (`choose_kernels`), where it runs on the CPU in float32 or bfloat16 and this torch build
    has oneDNN.

    Kernels that run on a second copy of the weights (float16 for fbgemm, oneDNN's blocked layout) are candidates
    only when that copy, 2 bytes a weight, fits in half the memory the system has available now. Float16 copies
    are made here (logged with how long it took), oneDNN's at a weight's first input of the rows they
    were chosen for. In bfloat16 where oneDNN has no bfloat16 kernels (AVX2), one new position attends through
    `one_position_attention`.
    """
    weight = model.tok_embeddings.weight
    if not onednn_supported(weight.device) or weight.dtype not in (torch.float32, torch.bfloat16):
        return
    use_cpu_linear_layers(model)
    copy_bytes = sum(p.numel() * 2 for p in model.parameters())  # a bfloat16 or float16 copy of every weight
    copies = 2 * copy_bytes <= available_memory()
    if copies and fbgemm_fp16_supported():
        fuse_fp16_products(model)
    choose_kernels(model, row_counts(model.params.max_batch_size), copies)
    if weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
        for block in model.layers:
            block.attention.one_position_attention = one_position_attention
    make_fp16_copies(model)
