"""Weights with 8-bit activations (`quantize="int8-dyn"` and `"int4-dyn"`), on the CPU: the one module that runs
ONNX Runtime.

PyTorch's int8 and int4 kernels for the CPU multiply in floating point, and read the weight slower than the memory
allows (docs/quantize-kernels.md). llama.cpp's Q8_0 and Q4_0 read faster because they also round each block of 32
activations to 8 bits and multiply integers. ONNX Runtime's `MatMulNBits` operator (com.microsoft domain,
`accuracy_level=4`) does the same with its MLAS kernels, on weights with a scale (and for 4 bits an integer zero
point) per group, and is fast on many rows too. It is an optional dependency (`pip install "llama[onnx]"`);
without it the same numbers are computed by `reference_product` in PyTorch, slowly.

The weights, in groups of 32 inputs, each with a float32 scale:
- int8-dyn (`quantize_int8_dyn`): w = (q - 128) * scale, q in [1, 255] (symmetric: the scale is the group's largest
  magnitude / 127), as Q8_0 holds them;
- int4-dyn (`quantize_int4_dyn`): w = (q - zero_point) * scale, q and the zero point in [0, 15]. Unlike "int4"
  (`llama.quantize.quantize_int4`, a float zero), this form is what MatMulNBits reads.
The activations: each row's blocks of 32 values rounded to int8 with a scale of their largest magnitude / 127 (as
Q8_0 rounds them); the products of a block summed in integers, then scaled.
"""

import contextlib
import functools
import itertools
from typing import List, Optional, Tuple

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import RowParallelLinear
from torch import nn

from llama.distributed import release_freed_memory
from llama.quantize import int4_group_for, pack_nibbles, row_chunks, unpack_nibbles, whole_shape
from llama.runtime.quantized import QuantizedLinear

GROUP_SIZE = 32  # inputs per weight group and per activation block
INT8_ZERO_POINT = 128  # the zero point MatMulNBits gives 8-bit weights passed without zero points
SCALE_ROUNDS = 2  # least-squares refits of each group's step (`quantize_int4_dyn`)


@functools.cache
def onnxruntime_available() -> bool:
    """Whether ONNX Runtime and onnx (to write the operator's graph) can be imported."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_int4_dyn(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, zero_points) of a 2-D weight in groups of `GROUP_SIZE` along each row: codes in [0, 15], two
    per byte (`pack_nibbles`); float32 scales and uint8 zero points, one column per group.

    Each group's range is first widened to hold 0 (so that its zero point is a code and a weight of 0 stays 0) and
    cut in 15 steps; then, `SCALE_ROUNDS` times, the step is set to the one that fits the group's levels best (least
    squares) and the levels are rounded again: on SmolLM2 that takes the scheme's KL divergence from bfloat16 from
    0.264 to below llama.cpp Q4_0's (docs/quantize.md)."""
    weight, (rows, cols) = weight.detach(), weight.shape
    codes = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // GROUP_SIZE, dtype=torch.float32)
    zero_points = torch.empty(rows, cols // GROUP_SIZE, dtype=torch.uint8)
    for rows_here, chunk in row_chunks(weight):
        groups = chunk.view(chunk.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scale = (high - low) / 15
        for refit in range(SCALE_ROUNDS + 1):
            safe = torch.where(scale > 0, scale, 1.0)
            zero = (-low / safe).round_().clamp_(0, 15)
            levels = (groups / safe[..., None]).round_().add_(zero[..., None]).clamp_(0, 15)
            if refit < SCALE_ROUNDS:
                steps = levels.sub_(zero[..., None])  # each weight's level, in steps from the zero point
                fitted = (groups * steps).sum(dim=-1) / steps.square().sum(dim=-1).clamp_(min=1)
                scale = torch.where(fitted > 0, fitted, scale)
        codes[rows_here] = pack_nibbles(levels.to(torch.uint8).view(chunk.shape))
        scales[rows_here], zero_points[rows_here] = scale, zero.to(torch.uint8)
    return codes, scales, zero_points


def quantize_int8_dyn(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a 2-D weight in groups of `GROUP_SIZE` along each row: uint8 codes, the levels in [-127,
    127] plus `INT8_ZERO_POINT`, and one float32 scale per group, its largest magnitude / 127."""
    weight, (rows, cols) = weight.detach(), weight.shape
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scales = torch.empty(rows, cols // GROUP_SIZE, dtype=torch.float32)
    for rows_here, chunk in row_chunks(weight):
        groups = chunk.view(chunk.shape[0], -1, GROUP_SIZE)
        scale = groups.abs().amax(dim=-1) / 127
        levels = groups.div_(torch.where(scale > 0, scale, 1.0)[..., None]).round_().add_(INT8_ZERO_POINT)
        codes[rows_here] = levels.to(torch.uint8).view(chunk.shape)
        scales[rows_here] = scale
    return codes, scales


def dequantize_dyn(codes: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor]) -> torch.Tensor:
    """The float32 weight that `quantize_int8_dyn`'s (`zero_points` None) or `quantize_int4_dyn`'s values stand
    for."""
    rows, groups = scales.shape
    if zero_points is None:
        levels = codes.view(rows, groups, GROUP_SIZE).float() - INT8_ZERO_POINT
    else:
        levels = unpack_nibbles(codes).view(rows, groups, GROUP_SIZE).float() - zero_points.float()[..., None]
    return (levels * scales[..., None]).view(rows, -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32, rows by inputs) with each block of `GROUP_SIZE` values rounded to int8 steps of its largest
    magnitude / 127, as the values the integer products see (a block of zeros stays zero)."""
    blocks = x.view(*x.shape[:-1], -1, GROUP_SIZE)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, 1.0)
    return (torch.round(blocks / safe) * scale).view(x.shape)


def reference_product(x: torch.Tensor, codes, scales, zero_points) -> torch.Tensor:
    """The product MatMulNBits computes, in PyTorch: 8-bit activations times the dequantized weight, in float32
    (every product and every block's sum exact; the blocks summed in another order than MLAS's)."""
    rows = quantize_activations(x.reshape(-1, x.shape[-1]).float())
    return F.linear(rows, dequantize_dyn(codes, scales, zero_points))


class MatMulNBits:
    """An ONNX Runtime session whose one operator, MatMulNBits with 8-bit activations, multiplies float32 rows by
    the weight that `quantize_int8_dyn`'s or `quantize_int4_dyn`'s values stand for. The session reads the values
    where they are (initializers given as external data: not copied) and, where MLAS has a kernel for the weight's
    bits, packs a copy of its own for it as it is made (`packs_its_own_copy`).
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor]):
        import onnxruntime
        from onnx import TensorProto, helper

        out_features, groups = scales.shape
        in_features = groups * GROUP_SIZE
        bits = 8 if zero_points is None else 4
        arrays = {"codes": codes.view(out_features, groups, GROUP_SIZE * bits // 8).numpy(), "scales": scales.numpy()}
        types = {"codes": TensorProto.UINT8, "scales": TensorProto.FLOAT, "zero_points": TensorProto.UINT8}
        if zero_points is not None:  # two per byte, as the codes, for an even count
            padded = torch.cat([zero_points, zero_points.new_zeros(out_features, groups % 2)], dim=1)
            arrays["zero_points"] = pack_nibbles(padded).numpy()
        node = helper.make_node(
            "MatMulNBits",
            ["rows", *arrays],
            ["product"],
            domain="com.microsoft",
            K=in_features,
            N=out_features,
            bits=bits,
            block_size=GROUP_SIZE,
            accuracy_level=4,  # activations rounded to int8 per block, integer products
        )
        graph = helper.make_graph(
            [node],
            f"int{bits}_dyn",
            [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["rows", in_features])],
            [helper.make_tensor_value_info("product", TensorProto.FLOAT, ["rows", out_features])],
            initializer=[external_initializer(name, types[name], array.shape) for name, array in arrays.items()],
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        # No memory arena per session: each would keep the largest product it ever returned (a long prompt's), a
        # hundred times over.
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # torch's threads run between calls
        values = [onnxruntime.OrtValue.ortvalue_from_numpy(array) for array in arrays.values()]
        options.add_external_initializers(list(arrays), values)
        self.session = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        (product,) = self.session.run(None, {"rows": rows.float().contiguous().numpy()})
        return torch.from_numpy(product)

    def __deepcopy__(self, memo) -> "MatMulNBits":
        return self  # a session only reads its weight: copies of a model share it

    def __reduce__(self):
        raise ValueError(
            "An int8-dyn or int4-dyn layer's weight lives in its ONNX Runtime session and cannot be saved: save the "
            "checkpoint it was loaded from instead, and quantize it as it loads again"
        )


@functools.cache
def packs_its_own_copy(bits: int) -> bool:
    """Whether a `MatMulNBits` session of `bits` bits multiplies from the copy it packed as it was made, no longer
    reading the values it was given (which may then be freed). ONNX Runtime packs a copy where MLAS has a kernel for
    8-bit activations at these bits, and otherwise reads the given values at every call; found by overwriting the
    values of a small session's weight once it is made."""
    weight = torch.randn(16, 2 * GROUP_SIZE, generator=torch.Generator().manual_seed(0))
    values = (*quantize_int8_dyn(weight), None) if bits == 8 else quantize_int4_dyn(weight)
    session = MatMulNBits(*values)
    rows = torch.ones(1, weight.shape[1])
    product = session(rows)
    for tensor in values:
        if tensor is not None:
            tensor.zero_()
    return torch.equal(session(rows), product)


def external_initializer(name: str, data_type: int, shape):
    """A graph initializer with no bytes of its own: the session is given them (`add_external_initializers`)."""
    from onnx import TensorProto

    tensor = TensorProto(name=name, data_type=data_type, dims=shape, data_location=TensorProto.EXTERNAL)
    tensor.external_data.add(key="location", value=name)
    return tensor


class DynLinear(QuantizedLinear):
    """A fairscale linear layer with an "int8-dyn" weight (the codes, `scales`) or an "int4-dyn" one (the codes,
    `scales`, `zero_points`), on the CPU.

    Products: "matmulnbits", ONNX Runtime's operator (the default where it is installed), on a session made at the
    layer's first product or when `for_runtime` makes them all (`make_session`), or on the session of the fused
    product it is part of (`FusedDyn`). Where a session multiplies from a packed copy of its own
    (`packs_its_own_copy`), the layer lets the values go (`weight`, `scales` and `zero_points` become None), so that
    the weight is held once. "reference", the same numbers in PyTorch from the values, where ONNX Runtime is not
    installed. Inputs are taken in float32 and the result rounded to their dtype."""

    def __init__(
        self, layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor] = None
    ):
        super().__init__(layer)
        del self.weight
        self.out_features, self.in_features = codes.shape[0], scales.shape[1] * GROUP_SIZE  # this process's slice
        self.bits = 8 if zero_points is None else 4
        self.made_from_bytes = sum(t.numel() * t.element_size() for t in (codes, scales, zero_points) if t is not None)
        self.session: Optional[MatMulNBits] = None
        self.part_of: Optional[Tuple[MatMulNBits, int, int]] = None  # a fused session, and this layer's columns in it
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_points", zero_points)

    @property
    def scheme(self) -> str:
        return "int8-dyn" if self.bits == 8 else "int4-dyn"

    def default_kernel(self) -> str:
        return "matmulnbits" if onnxruntime_available() else "reference"

    def values_bytes(self) -> int:
        return self.made_from_bytes  # held by a session where the layer let them go

    def values(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        return self.weight, self.scales, self.zero_points

    def make_session(self) -> None:
        """Its own ONNX Runtime session, where ONNX Runtime is installed and none serves it yet; then its values go
        where the session packed a copy of them."""
        if onnxruntime_available() and self.session is None and self.part_of is None:
            self.session = MatMulNBits(*self.values())
            self.let_values_go()

    def let_values_go(self) -> None:
        """Where its session packed a copy of the values, free them, and hand their memory back to the system at once
        (glibc would keep much of it, as the sessions made after allocate elsewhere: 700 MB at 1B in int8-dyn)."""
        if packs_its_own_copy(self.bits):
            self.weight = self.scales = self.zero_points = None
            release_freed_memory()

    def products(self, rows: int) -> dict:
        if onnxruntime_available():
            return {"matmulnbits": self.matmulnbits_product}
        return {"reference": self.reference_product}

    def activation_dtype(self) -> torch.dtype:
        return torch.float32

    def reference_product(self, x: torch.Tensor) -> torch.Tensor:
        y = reference_product(x, self.weight, self.scales, self.zero_points)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def matmulnbits_product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.part_of is not None:  # run alone, outside its fused product: the fused one's columns for it
            session, start, stop = self.part_of
            y = session(rows)[:, start:stop]
        else:
            self.make_session()
            y = self.session(rows)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class FusedDyn(nn.Module):
    """`DynLinear` layers of one scheme that always take the same input (an attention's wq, wk and wv; a feed-forward's
    w1 and w3), run as one `MatMulNBits` session on their values stacked. Fewer, larger products: each session call
    costs some tens of microseconds beyond reading its weight. Each output column is computed as in its layer's
    own product, so the outputs are the same bits (tested).

    The layers stay where they are, with their state-dict keys, and let their values go once the session is made
    (`DynLinear.let_values_go`); this module holds no parameters of its own."""

    def __init__(self, *layers: DynLinear):
        super().__init__()
        self.layers = layers  # a tuple, not submodules: the layers keep their own keys
        self.session = MatMulNBits(*stacked_values(layers))  # the stacked copies are freed as it returns
        self.sizes = [layer.out_features for layer in layers]
        for layer, stop in zip(layers, itertools.accumulate(self.sizes)):
            layer.part_of = (self.session, stop - layer.out_features, stop)
            layer.let_values_go()

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Each layer's output for `x`, in the layers' order."""
        y = self.session(x.reshape(-1, x.shape[-1])).to(x.dtype)
        return tuple(part.view(*x.shape[:-1], -1) for part in y.split(self.sizes, -1))

    def extra_repr(self) -> str:
        return "+".join(map(str, self.sizes)) + f"x{self.layers[0].in_features} {self.layers[0].scheme}"


def stacked_values(layers: Tuple[DynLinear, ...]) -> List[Optional[torch.Tensor]]:
    """The codes, scales and zero points of `layers`, each stacked in the layers' order (rows of outputs)."""
    each_values = zip(*(layer.values() for layer in layers))  # the codes of each layer, then the scales, ...
    return [None if parts[0] is None else torch.cat(parts) for parts in each_values]


def fused_dyn(*layers: nn.Module) -> Optional[FusedDyn]:
    """`layers` (that take one input) as one `FusedDyn` where they are `DynLinear` layers of one scheme, none run yet,
    and ONNX Runtime is installed; else None."""
    if not onnxruntime_available() or not all(isinstance(layer, DynLinear) for layer in layers):
        return None
    already_run = any(layer.session is not None or layer.part_of is not None for layer in layers)
    if len({layer.bits for layer in layers}) > 1 or already_run:
        return None
    return FusedDyn(*layers)


def make_sessions(model: nn.Module) -> None:
    """Every `DynLinear` of `model` outside a fused product gets its session now, rather than at its first product
    (where the first prompt would wait for it); where ONNX Runtime is installed."""
    for layer in model.modules():
        if isinstance(layer, DynLinear):
            layer.make_session()


def int8_dyn_layer(layer: nn.Module) -> Optional[DynLinear]:
    """A `DynLinear` in int8-dyn of one fairscale linear layer (this process's slice of it), or None where its
    inputs are not whole groups of 32 (then the groups of a slice would not be those of the whole weight)."""
    if layer.weight.shape[1] % GROUP_SIZE:
        return None
    return DynLinear(layer, *quantize_int8_dyn(layer.weight))


def int4_dyn_layer(layer: nn.Module) -> Optional[DynLinear]:
    """A `DynLinear` in int4-dyn of one fairscale linear layer (this process's slice of it), or None where int4's
    groups of 32 cannot hold the weight (`llama.quantize.int4_group_for`)."""
    mp_size = fs_init.get_model_parallel_world_size()
    row_parallel = isinstance(layer, RowParallelLinear)
    if int4_group_for(*whole_shape(layer), GROUP_SIZE, row_parallel, mp_size) != GROUP_SIZE:
        return None
    return DynLinear(layer, *quantize_int4_dyn(layer.weight))


def runs_on_onnx_runtime(model: nn.Module) -> bool:
    """Whether any of `model`'s products runs on ONNX Runtime."""
    return onnxruntime_available() and any(isinstance(m, DynLinear) for m in model.modules())


@contextlib.contextmanager
def one_torch_thread():
    """PyTorch's own operations on one thread inside the block. Where the products run on ONNX Runtime's threads,
    PyTorch's OpenMP threads would keep spinning on the cores after each of its operations (for milliseconds) while
    ONNX Runtime's product waits for them: decoding 1B in int4-dyn on 2 cores, the products took 86 ms a step
    against 53 (docs/quantize.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
