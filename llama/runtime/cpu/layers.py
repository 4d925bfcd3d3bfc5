"""The CPU's float linear layers: `CPULinear` runs each row class on the kernel the kernel table gives it."""

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from llama.runtime.cpu.kernels import fbgemm_fp16_supported, fp16_linear, holds_bfloat16_values, pack_as_fp16
from llama.runtime.kernel_table import cpu_offers
from llama.runtime.parallel_layers import KernelLinear


class CPULinear(KernelLinear):
    """A fairscale `ColumnParallelLinear` or `RowParallelLinear` whose matmul runs on the kernel of its row class.

    Kernels: "linear", `F.linear` (the reference's call); "onednn", oneDNN's kernel, in bfloat16 on a copy of the
    weight in oneDNN's blocked layout (what `F.linear` runs there, bit for bit, without reordering the weight at every
    call), in float32 on the weight as loaded; "fp16", fbgemm on a float16 copy of a weight that holds bfloat16 values
    (`pack_as_fp16`). The copies are made at load (`make_copies`), and again at the next call after the weight was
    replaced or changed in place. The forward is fairscale's with that matmul in place of `F.linear`
    (`ParallelLinear`); the weight is the same parameter, so it can be edited or tied as usual.
    """

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.copy = None  # (the kernel, the weight and its version when copied, the copy)

    def default_kernel(self) -> str:
        return "linear"

    def weights(self) -> str:
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"{dtype} holding bfloat16" if dtype == "float32" and holds_bfloat16_values(self.weight) else dtype

    def runs(self, kernel: str) -> bool:
        if kernel == "fp16":
            return fbgemm_fp16_supported() and holds_bfloat16_values(self.weight)
        if kernel == "onednn":
            return self.weight.dtype == torch.float32 or (
                self.weight.dtype == torch.bfloat16 and cpu_offers().onednn_bf16
            )
        return kernel == "linear"

    def copy_kernel(self) -> Optional[str]:
        """The kernel of its row classes that runs on a copy of the weight (at most one: the table's rows name one),
        or None."""
        return next((kernel for kernel in self.kernels or () if self.on_a_copy(kernel)), None)

    def on_a_copy(self, kernel: str) -> bool:
        """Whether `kernel` runs on a copy of the weight: fbgemm's float16 one, or oneDNN's layout in bfloat16."""
        return kernel == "fp16" or (kernel == "onednn" and self.weight.dtype == torch.bfloat16)

    def copy_bytes(self) -> int:
        return 2 * self.weight.numel() if self.copy_kernel() else 0

    def make_copies(self) -> None:
        if self.in_stack or self.copy_kernel() is None:
            self.copy = None  # its stack holds the copy, or no kernel of its reads one
        else:
            self.weight_copy(self.copy_kernel())

    def weight_copy(self, kernel: str):
        """The weight's copy for `kernel`, made again first where the weight was replaced or changed in place since
        (seen through its version counter, which in-place ops bump; writes through `.data` do not)."""
        held = self.copy is not None and self.copy[0] == kernel and self.copy[1] is self.weight
        if not held or self.copy[2] != self.weight._version:
            self.copy = None  # the old copy freed first
            self.copy = (kernel, self.weight, self.weight._version, self.copy_of(kernel, [self]))
        return self.copy[3]

    @staticmethod
    def copy_of(kernel: str, layers: Sequence["CPULinear"]):
        """The copy `kernel` runs on of the layers' weights stacked by rows (for "fp16", None where float16 cannot
        hold them)."""
        weight = layers[0].weight if len(layers) == 1 else torch.cat([layer.weight for layer in layers])
        if kernel == "fp16":
            return pack_as_fp16(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    @staticmethod
    def on_copy(kernel: str, x: torch.Tensor, copy) -> torch.Tensor:
        """`x` times the weights `kernel` reads: a copy of them (`copy_of`), or for oneDNN in float32 the weight as
        loaded."""
        if kernel == "fp16":
            return fp16_linear(x, copy)
        return torch.ops.mkldnn._linear_pointwise(x, copy, None, "none", [], "")

    def fp16(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.weight_copy("fp16")
        return F.linear(x, self.weight) if packed is None else self.on_copy("fp16", x, packed)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight.dtype == torch.float32 else self.weight_copy("onednn")
        return self.on_copy("onednn", x, weight)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    KERNELS = {"fp16": fp16, "onednn": onednn, "linear": linear}

    def __getstate__(self):
        # An opaque packed tensor cannot be copied or saved; a copy of this layer makes its own on use.
        return {**super().__getstate__(), "copy": None}
