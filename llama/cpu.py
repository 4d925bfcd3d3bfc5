"""CPU speed-up, applied at load: each linear layer's product on the kernel that runs it fastest on this CPU.

Which kernel is fastest depends on the CPU (AVX2 or AVX-512, bfloat16 instructions or not), the torch build, the
shape and the number of rows, so it is measured here rather than guessed from CPU flags: at load, for each product
shape and the row counts that matter (one row, the batch, a prompt), the kernels that keep the math
(`candidate_kernels`) are timed (`time_kernels`) and the fastest is kept; the choice is cached per CPU, torch
version and shape (`KernelCache`), so a later load does not measure again. `LLAMA_CPU_KERNEL` pins one kernel.

Every kernel keeps the reference math: only the order in which the float32 products are summed changes, and on
float16 copies of weights that hold bfloat16 values (`pack_as_fp16`: bfloat16 weights, or float32 ones from a
bfloat16 checkpoint) the smallest weights round by less than 3e-8. Tests hold logits within 1e-4 of the reference
math in float32 and greedy tokens equal. Figures: `benchmarks/bench.py`, docs/speed.md.
"""

import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

from llama.distributed import available_memory, global_rank
from llama.parallel_layers import ParallelLinear, replace_layers

logger = logging.getLogger(__name__)


def onednn_supported(device: torch.device) -> bool:
    """Whether this torch build can run `CPULinear` layers on `device`."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def onednn_bf16_supported() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX-512 or AVX-NE-CONVERT); without them it cannot pack
    bfloat16 weights, and AVX2 machines lack them."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and check()


def fbgemm_fp16_supported() -> bool:
    """Whether this torch build has fbgemm's float16-weight linear kernels (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_prepack_fp16"
    )


FP16_MAX = torch.finfo(torch.float16).max
FP16_BLOCK_VALUES = 2**24  # fbgemm packs blocks of this size 3-4x faster than a 128256-row head whole


def holds_bfloat16_values(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is a bfloat16 value: true of bfloat16 weights, and of float32 ones loaded
    from a bfloat16 checkpoint, whose low 16 bits are then zero (counted on a view of them: no copy is made)."""
    if weight.dtype == torch.bfloat16:
        return True
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return False
    low_halves = weight.view(torch.int16).view(*weight.shape, 2)[..., 0 if sys.byteorder == "little" else 1]
    return int(torch.count_nonzero(low_halves)) == 0


def pack_as_fp16(*weights: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """fbgemm's packed float16 copy of `weights` stacked by rows (one weight, or the weights of layers that share
    an input), in blocks of rows, or None where float16 cannot hold them: a value that is not a bfloat16 value
    (`holds_bfloat16_values`; checked before anything is stacked), lies outside float16's range, or is not finite.

    Within that range float16 holds every bfloat16 value exactly, except those below 2**-17 in magnitude, which
    it rounds to a multiple of 2**-24 (float16's subnormals): a change below 3e-8 per weight.
    """
    if not all(holds_bfloat16_values(weight) for weight in weights):
        return None
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    rows = max(1, FP16_BLOCK_VALUES // weight.shape[1])
    packed = []
    for block in weight.detach().split(rows):
        block = block.float()
        if not (block.amax() <= FP16_MAX and block.amin() >= -FP16_MAX):  # also false for NaN
            return None
        packed.append(torch.ops.quantized.linear_prepack_fp16(block, None))
    return packed


def fp16_products(rows: torch.Tensor, packed: List[torch.Tensor]) -> List[torch.Tensor]:
    """fbgemm's product of float32 `rows` with each block of a packed float16 weight.

    Called as a `torch.ops` op, each product first looks for `__torch_function__` on its arguments, and on the
    packed weight (a TorchScript object) that lookup raises an AttributeError in C++ and catches it: some 14 us
    of a small product's 19 here, over 30 calls a step for a model of 8 layers. With torch functions of tensor
    subclasses switched off for the call (the activations are plain tensors), the lookup is skipped.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return [torch.ops.quantized.linear_dynamic_fp16(rows, block) for block in packed]


def fp16_linear(x: torch.Tensor, packed: List[torch.Tensor]) -> torch.Tensor:
    """`x @ weight.T` on the packed float16 weight: float32 input and sums, the result rounded to `x.dtype`."""
    y = fp16_products(x.reshape(-1, x.shape[-1]).float(), packed)
    y = y[0] if len(y) == 1 else torch.cat(y, dim=-1)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def with_versions(weights: List[torch.Tensor]) -> list:
    """Each weight with its version now, to tell later whether a copy made from them still holds them."""
    return [(weight, weight._version) for weight in weights]


def unchanged(recorded: list, weights: List[torch.Tensor]) -> bool:
    """Whether `weights` are the tensors `with_versions` recorded, none replaced or changed in place since.

    A change is seen through the tensor's version counter, which in-place ops bump (under `torch.no_grad()` or
    `load_state_dict`); writes through `.data` do not bump it.
    """
    return all(weight is old and weight._version == version for weight, (old, version) in zip(weights, recorded))


# The kernels a product can run on. Each computes `x @ weight.T` with float32 products summed in float32 (the
# result rounded to the input's dtype, as `F.linear` rounds it); they differ in the order of the sums only.
KERNELS = ("fp16", "onednn", "mv", "linear")
KERNEL_VARIABLE = "LLAMA_CPU_KERNEL"  # pins one kernel for every product it can run: for tests and bisecting
PROMPT_ROWS = 256  # the row count a prompt is measured at; inputs of more rows than the batch use its choice
DECODE_SAMPLE_VALUES = 2**22  # one row and the batch: timed on up to this many weights of a product (from memory)
PROMPT_SAMPLE_VALUES = 2**20  # a prompt: fewer, since it is bound by arithmetic rather than by reading the weight
TIMED_ROUNDS = 2  # after a warm-up round; each kernel keeps its best round


def candidate_kernels(dtype: torch.dtype, rows: int, fp16_holds: bool, copies: bool) -> List[str]:
    """The kernels that keep the reference math for a product of `rows` rows with weights of `dtype` here.

    `fp16_holds`: float16 holds the weights exactly (`holds_bfloat16_values`); `copies`: memory allows a second
    copy of the weights (a float16 copy, or oneDNN's packed one).
    """
    kernels = []
    if fp16_holds and copies and fbgemm_fp16_supported():
        kernels.append("fp16")  # fbgemm on a float16 copy: float32 products of the same numbers
    if dtype == torch.float32:
        kernels.append("onednn")  # oneDNN's float32 kernel on the weight as loaded
    elif copies and onednn_bf16_supported():
        kernels.append("onednn")  # oneDNN's bfloat16 kernel on a copy in its blocked layout: F.linear's own kernel
    if rows == 1:
        kernels.append("mv")  # PyTorch's matrix-vector product, what F.linear runs for one row without oneDNN
    kernels.append("linear")  # F.linear, the reference's own call
    return kernels


def pinned_kernel() -> Optional[str]:
    """The kernel `LLAMA_CPU_KERNEL` pins, or None where it is unset (or empty): the kernels are measured."""
    kernel = os.environ.get(KERNEL_VARIABLE, "").strip()
    if kernel and kernel not in KERNELS:
        choices = ", ".join(KERNELS)
        raise ValueError(f"{KERNEL_VARIABLE}={kernel!r} is not a CPU kernel: set one of {choices}, or unset it")
    return kernel or None


def run_kernel(kernel: str, x: torch.Tensor, weight: torch.Tensor, packed) -> torch.Tensor:
    """`x @ weight.T` on `kernel`; `packed` is the weight's copy for the kernels that run on one (float16 blocks
    for "fp16", oneDNN's layout for "onednn" in bfloat16)."""
    if kernel == "fp16":
        return fp16_linear(x, packed)
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight if packed is None else packed, None, "none", [], "")
    if kernel == "mv" and x.numel() == x.shape[-1]:
        return torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], -1)
    return F.linear(x, weight)


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
    of a shared machine falls on all of them; before each call `flush` (if any) evicts the caches, since in a
    decode step each weight comes from memory, the rest of the model having been read since. A kernel more than
    twice as slow as the best after a round is not timed again."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, math.inf)
    timed = list(runs)
    for _ in range(TIMED_ROUNDS):
        for kernel in timed:
            if flush is not None:
                flush()
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


class CPULinear(ParallelLinear):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the kernel chosen for it.

    `kernels` maps row counts to kernels (`KERNELS`): an input of n rows runs on the kernel of the smallest count
    that is at least n, or of the largest count (a long prompt). `speed_up_for_cpu` chooses them by measuring.
    The copies some kernels run on are made at their first use, and again whenever the weight has changed since
    (`packed_copy`): "fp16" runs on fbgemm's packed float16 copy (`pack_as_fp16`; where float16 cannot hold the
    weight, on `F.linear`), "onednn" in bfloat16 on a copy in oneDNN's blocked layout, the kernel `F.linear` runs
    there (bit-identical results) without reordering the weight on every call. The forward is fairscale's with
    that matmul in place of `F.linear` (`ParallelLinear`); the weight is the same parameter, so it can be edited
    or tied as usual.
    """

    def __init__(self, layer: nn.Module, kernels: Optional[Dict[int, str]] = None):
        super().__init__(layer)
        kernels = kernels or {1: "linear"}
        unknown = set(kernels.values()) - set(KERNELS)
        if unknown:
            raise ValueError(f"Unknown CPU kernels {sorted(unknown)}: the kernels are {', '.join(KERNELS)}")
        if "onednn" in kernels.values() and self.weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
            raise ValueError("The 'onednn' kernel needs oneDNN's bfloat16 kernels, which this CPU lacks (no AVX-512)")
        if "fp16" in kernels.values() and not fbgemm_fp16_supported():
            raise ValueError("The 'fp16' kernel needs fbgemm's float16 kernels, which this torch build lacks")
        self.kernels = dict(sorted(kernels.items()))
        self.packed = {}  # kernel -> (the weight and its version when copied, the copy)
        self.fused: Optional[FusedProduct] = None  # for "fp16": a copy shared with layers of the same input

    def kernel_for(self, rows: int) -> str:
        return next(
            (kernel for count, kernel in self.kernels.items() if rows <= count), self.kernels[max(self.kernels)]
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # torch.compile picks its own kernels
            return F.linear(x, self.weight)
        kernel = self.kernel_for(x.numel() // max(1, x.shape[-1]))
        if kernel == "fp16":
            if self.fused is not None:
                y = self.fused.output(self, x)
            else:
                packed = self.packed_copy("fp16")
                y = None if packed is None else fp16_linear(x, packed)
            return F.linear(x, self.weight) if y is None else y
        packed = self.packed_copy("onednn") if kernel == "onednn" and self.weight.dtype != torch.float32 else None
        return run_kernel(kernel, x, self.weight, packed)

    def packed_copy(self, kernel: str):
        """The weight's copy for `kernel` (None where `pack_as_fp16` cannot hold it), made again if the weight was
        replaced or changed in place since (`unchanged`)."""
        if kernel not in self.packed or not unchanged(self.packed[kernel][0], [self.weight]):
            self.packed.pop(kernel, None)  # free the old copy first
            if kernel == "fp16":
                packed = pack_as_fp16(self.weight)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            self.packed[kernel] = (with_versions([self.weight]), packed)
        return self.packed[kernel][1]

    def __getstate__(self):
        # An opaque packed tensor cannot be copied or saved; a copy of this layer packs its own on use.
        return {**super().__getstate__(), "packed": {}}


class FusedProduct:
    """One float16 copy of the stacked weights of `CPULinear` layers that always take the same input (an attention's
    wq, wk and wv; a feed-forward's w1 and w3), for their "fp16" kernel: the first layer called with an input
    computes all their products at once, and the others take their share when called with that same input object
    (each output column is summed as in a product of its layer alone: the same bits, tested). Fewer, larger
    products: each fbgemm call costs some 20 to 40 us beyond reading its weight on 2 cores, and a larger weight is
    read nearer the memory's speed: a few percent, up to some 10% for batches (`benchmarks/on_off.py fused`). The
    layers keep their own weights and state-dict keys; the copy is made again at its next use when any of them was
    replaced or edited in place.
    """

    def __init__(self, layers: List["CPULinear"]):
        self.layers = layers
        self.packed = {}  # "fp16" -> (each weight and its version when packed, the packed copy)
        self.pending = None  # (an input, the outputs for it that layers have not taken yet)

    def packed_copy(self, kernel: str = "fp16") -> Optional[List[torch.Tensor]]:
        """The stacked weights' float16 copy (None where float16 cannot hold one of them), made again if one of
        them was replaced or changed in place since (`unchanged`)."""
        weights = [layer.weight for layer in self.layers]
        if kernel not in self.packed or not unchanged(self.packed[kernel][0], weights):
            self.packed.pop(kernel, None)  # free the old copy first
            self.packed[kernel] = (with_versions(weights), pack_as_fp16(*weights))
        return self.packed[kernel][1]

    def output(self, layer: "CPULinear", x: torch.Tensor) -> Optional[torch.Tensor]:
        """`layer`'s product with `x` (None where float16 cannot hold the weights)."""
        pending = self.pending
        if pending is None or pending[0] is not x or layer not in pending[1]:
            packed = self.packed_copy()
            if packed is None:
                return None
            outputs = fp16_linear(x, packed).split([layer.weight.shape[0] for layer in self.layers], dim=-1)
            self.pending = pending = (x, dict(zip(self.layers, outputs)))
        output = pending[1].pop(layer)
        if not pending[1]:
            self.pending = None  # every layer has its share: let go of the input
        return output

    def __getstate__(self):
        return {**self.__dict__, "packed": {}, "pending": None}  # as CPULinear: a copy packs its own


def fuse_fp16_products(model: nn.Module) -> None:
    """Give each attention's wq, wk and wv, and each feed-forward's w1 and w3, one shared float16 copy for their
    "fp16" kernel (`FusedProduct`), where float16 holds their weights and their stack fits in one packed block: a
    larger stack is packed in blocks of rows anyway, whose outputs would have to be joined (for Llama 3.2 1B's w1
    and w3, prompts ran about 4% slower)."""
    for block in model.layers:
        for group in (
            [block.attention.wq, block.attention.wk, block.attention.wv],
            [block.feed_forward.w1, block.feed_forward.w3],
        ):
            if (
                all(isinstance(layer, CPULinear) for layer in group)
                and sum(layer.weight.numel() for layer in group) <= FP16_BLOCK_VALUES
                and all(holds_bfloat16_values(layer.weight) for layer in group)
            ):
                fused = FusedProduct(group)
                for layer in group:
                    layer.fused = fused


def products(model: nn.Module) -> List[List[CPULinear]]:
    """The products a step runs: the layers of each fused group together, every other `CPULinear` alone."""
    found = {}
    for layer in model.modules():
        if isinstance(layer, CPULinear):
            layers = layer.fused.layers if layer.fused is not None else [layer]
            found.setdefault(id(layers[0]), layers)
    return list(found.values())


def product_name(layers: List[CPULinear]) -> str:
    """What a product's kernel choice depends on: its dtype, its weights' shapes, and whether they are fused."""
    weight = layers[0].weight
    outputs = "+".join(str(layer.weight.shape[0]) for layer in layers)
    fused = " fused" if layers[0].fused is not None else ""
    return f"{str(weight.dtype).removeprefix('torch.')} {outputs}x{weight.shape[1]}{fused}"


def row_counts(max_batch_size: int) -> List[int]:
    """The row counts kernels are chosen for: one row (a decode step of one sequence), the batch, a prompt."""
    return [1] + ([max_batch_size] if 1 < max_batch_size < PROMPT_ROWS else []) + [PROMPT_ROWS]


def weight_sample(layers: List[CPULinear], max_values: int) -> List[torch.Tensor]:
    """Each layer's weight, or where the product holds more than `max_values` weights, its first rows, in
    proportion."""
    total = sum(layer.weight.numel() for layer in layers)
    if total <= max_values:
        return [layer.weight.detach() for layer in layers]
    return [layer.weight.detach()[: max(1, layer.weight.shape[0] * max_values // total)] for layer in layers]


def measure(layers: List[CPULinear], rows: int, candidates: List[str], flush) -> Dict[str, float]:
    """The best seconds of each candidate kernel for `rows` rows through the product of `layers` (`time_kernels`),
    on a sample of its weights (`weight_sample`), with the copies the kernels need made of the sample alone. One
    row and the batch are timed with the caches flushed before each call (as a decode step meets its weights);
    a prompt, bound by arithmetic, without."""
    decode = rows < PROMPT_ROWS
    weights = weight_sample(layers, DECODE_SAMPLE_VALUES if decode else PROMPT_SAMPLE_VALUES)
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(0)).to(weights[0].dtype)
    runs = {}
    for kernel in candidates:
        if kernel == "fp16":  # one product of the stacked weights, as a fused group runs
            copy = pack_as_fp16(*weights)
            if copy is not None:
                runs[kernel] = lambda copy=copy: fp16_linear(x, copy)
            continue
        packed = [None] * len(weights)
        if kernel == "onednn" and weights[0].dtype != torch.float32:
            packed = [torch.ops.mkldnn._reorder_linear_weight(weight) for weight in weights]
        runs[kernel] = lambda kernel=kernel, packed=packed: [
            run_kernel(kernel, x, weight, copy) for weight, copy in zip(weights, packed)
        ]
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
                        times = measure(layers, rows, candidates, flush_buffer.sum)
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


# From this many scores (query heads x positions attended) on, `one_position_attention` runs on float32 matmuls;
# below it SDPA's bfloat16 kernel is about as fast or faster (4 to 32 heads over 16 to 64 positions: 14 to 92 us
# against 76 to 107 us, which a dozen small operations cost whatever their size).
MATMUL_ATTENTION_MIN_SCORES = 2048


def one_position_attention(xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """bfloat16 attention of one new position per sequence (`Attention.one_position_attention`), rounded where
    Meta's code rounds it: the scores to bfloat16, then divided by sqrt(head_dim) in bfloat16, the softmax (in
    float32) to bfloat16, and the weighted sum of values to bfloat16. The products of bfloat16 values are exact in
    float32, so float32 matmuls give Meta's bfloat16 matmuls but for the order of their sums.

    Where oneDNN has no bfloat16 kernels (AVX2), SDPA's bfloat16 kernel attends one position slowly: for 32 query
    heads over 1000 positions about 2.2 ms here, against 0.4 ms this way; in Llama 3.2 1B at position 600, 2 ms of
    each layer's 7.7 ms (profiled). Below `MATMUL_ATTENTION_MIN_SCORES` scores, SDPA is as fast and is kept.
    """
    bsz, n_heads, _, head_dim = xq.shape
    n_kv_heads, positions = keys.shape[1], keys.shape[2]
    if n_heads * positions < MATMUL_ATTENTION_MIN_SCORES:
        return F.scaled_dot_product_attention(xq, keys, values, enable_gqa=n_heads > n_kv_heads)
    # Query head h attends with kv head h // (n_heads // n_kv_heads), as Meta's repeat_kv pairs them.
    queries = xq.reshape(bsz, n_kv_heads, n_heads // n_kv_heads, head_dim).float()
    scores = torch.matmul(queries, keys.float().transpose(2, 3)).to(xq.dtype).div_(math.sqrt(head_dim))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(xq.dtype)
    output = torch.matmul(probs.float(), values.float()).to(xq.dtype)
    return output.view(bsz, n_heads, 1, head_dim)


def use_cpu_linear_layers(model: nn.Module, kernels: Optional[Dict[int, str]] = None) -> None:
    """Replace every fairscale linear layer in `model` with a `CPULinear` on `kernels` (see there), in place."""
    replace_layers(model, (ColumnParallelLinear, RowParallelLinear), lambda layer: CPULinear(layer, kernels))


def make_fp16_copies(model: nn.Module) -> None:
    """Make the float16 copies of `model`'s `CPULinear` layers that run on them now rather than at each one's first
    use, on as many Python threads as torch uses: fbgemm packs a weight on one core."""
    layers = [m for m in model.modules() if isinstance(m, CPULinear) and "fp16" in m.kernels.values()]
    copies = {layer.fused or layer for layer in layers}  # a fused group's copy once
    start = time.perf_counter()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        made = sum(packed is not None for packed in pool.map(lambda owner: owner.packed_copy("fp16"), copies))
    seconds = time.perf_counter() - start
    if global_rank() == 0 and made:
        kept = f" ({len(copies) - made} of {len(copies)} not: float16 cannot hold them)" if made < len(copies) else ""
        logger.info("Made float16 copies of the weights for this CPU's kernels%s in %.2f seconds", kept, seconds)


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
    copy_bytes = sum(p.numel() * 2 for p in model.parameters())  # a bfloat16 or float16 copy of every weight
    copies = 2 * copy_bytes <= available_memory()
    use_cpu_linear_layers(model)
    if copies and fbgemm_fp16_supported():
        fuse_fp16_products(model)
    choose_kernels(model, row_counts(model.params.max_batch_size), copies)
    if weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
        for block in model.layers:
            block.attention.one_position_attention = one_position_attention
    make_fp16_copies(model)
