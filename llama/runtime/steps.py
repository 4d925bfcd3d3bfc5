"""The one place where a loaded reference `Transformer` becomes the model that runs here (`for_runtime`), in named
steps, in order. Nothing else in the package replaces a model's layers or sets attributes on them.
"""

import contextlib
import logging
import types
from typing import Callable, Optional, Tuple

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from torch import nn

from llama.model import Transformer
from llama.quantize import LOAD_SCHEMES, check_device, check_group_size, check_scheme
from llama.runtime.compiled import AnnouncedCompiles
from llama.runtime.cpu import (
    CPULinear,
    attention_kernel,
    choose_kernels,
    copies_that_fit,
    fused_product,
    make_weight_copies,
    measuring_alone,
    row_counts,
    runs_on_cpu_kernels,
)
from llama.runtime.cuda_graphs import CUDAGraphDecodeStep
from llama.runtime.onnx_dyn import GROUP_SIZE as DYN_GROUP_SIZE
from llama.runtime.onnx_dyn import fused_dyn, make_sessions, one_torch_thread, runs_on_onnx_runtime
from llama.runtime.parallel_layers import InferenceLayer, ParallelEmbedding, ParallelLinear, kernels_in_use
from llama.runtime.quantized import Int8Linear, is_quantized
from llama.runtime.quantized_kernels import choose_quantized_kernels
from llama.runtime.schemes import quantize_layer, quantize_named_layer
from llama.runtime.stacked import stacked_int8
from llama.runtime.transformer import DecodeStep, FuseProducts, RuntimeTransformer

LINEAR = (ColumnParallelLinear, RowParallelLinear)
logger = logging.getLogger(__name__)


def for_runtime(
    model: Transformer,
    *,
    compile: Optional[bool] = False,
    cuda_graphs: bool = False,
    model_parallel_size: int = 1,
    verify_rows: Optional[int] = None,
) -> Tuple[RuntimeTransformer, Optional[DecodeStep]]:
    """The runtime form of a loaded `Transformer` (quantized as it loaded, or not) and the decode step to run it
    with (None: eagerly, `RuntimeTransformer.decode_step` or `forward`). The same weights and math throughout; each
    step keeps the logits of the reference's algorithm, up to the order of float32 sums (tested).

    1. `use_cpu_kernels`: on the CPU (`runs_on_cpu_kernels`), each fairscale linear layer becomes a `CPULinear`, whose
       kernel per row count is chosen in step 3.
    2. `RuntimeTransformer`: the runtime modules (`llama.runtime.transformer`): fused products where the CPU runs
       them as one (`fuse_products`), the fixed-shape decode step, per-row positions and cache rows for the
       engine, and on the CPU float32 matmuls for one new position's bfloat16 attention from the cache length where
       they measure faster than SDPA (`attention_kernel`, on the threads PyTorch's operations decode on).
    3. `choose_cpu_kernels`: each product's kernels measured (or read from the cache), and the float16 copies made;
       with `verify_rows`, also for the rows of a speculative pass, which a prompt's kernel would run at its speed.
    4. `use_parallel_layers`: every fairscale layer left (all of them off the CPU) becomes `ParallelLinear` or
       `ParallelEmbedding`: the collectives called directly and skipped in one process, traceable by torch.compile.
    5. `choose_quantized_kernels`: on a GPU, each quantized weight's fastest product at each row count, timed. Where
       the products run on ONNX Runtime (int8-dyn, int4-dyn), the sessions of the layers not fused in step 2 are made
       (`make_sessions`), and PyTorch's own operations run on one thread (`one_torch_thread`), leaving the cores to
       ONNX Runtime's.
    6. The decode step: compiled with torch.compile if asked (`compiled_decode_step`; `compile=None` asks where
       `compiles_by_default`), else on one CUDA GPU replayed as CUDA graphs where `cuda_graphs` (`use_cuda_graphs`,
       `CUDAGraphDecodeStep`).

    Steps 2 to 5 time kernels or read what earlier loads timed, under `measuring_alone`: a load that starts while
    another process of this machine measures waits for it, and then chooses from its figures.
    """
    # What this CPU's kernels can do for the model, asked before its layers change.
    on_cpu_kernels = runs_on_cpu_kernels(model)
    copies = copies_that_fit(model) if on_cpu_kernels else 0  # copies of the weights kernels may run on: 0 to 2
    on_onnx_runtime = runs_on_onnx_runtime(model)
    with measuring_alone():  # loads started together on this machine measure in turn, and choose alike
        # Measured on the threads PyTorch's own operations decode on: one where ONNX Runtime runs the products.
        with one_torch_thread() if on_onnx_runtime else contextlib.nullcontext():
            one_position = attention_kernel(model) if on_cpu_kernels else None
        if on_cpu_kernels:
            use_cpu_kernels(model)
        runtime = RuntimeTransformer(model, fuse_products(copies), one_position)
        if on_cpu_kernels:
            choose_cpu_kernels(runtime, copies, verify_rows)
        use_parallel_layers(runtime)
        choose_quantized_kernels(runtime, model.params.max_seq_len, max(model.params.max_batch_size, verify_rows or 1))
    if on_onnx_runtime:
        make_sessions(runtime)
        runtime.threads = one_torch_thread
    runtime.kernels_in_use = kernels_in_use(runtime)  # what the load report says of the choices
    if compile is None and compiles_by_default(runtime, model_parallel_size):
        logger.info("Quantized weights on CUDA: the decode step will be compiled (compile=False replays CUDA graphs)")
        compile = True
    if compile:
        return runtime, compiled_step(runtime)
    if use_cuda_graphs(runtime.tok_embeddings.weight.device, model_parallel_size, cuda_graphs):
        return runtime, CUDAGraphDecodeStep(runtime)
    return runtime, None


def use_cuda_graphs(device: torch.device, model_parallel_size: int, requested: bool) -> bool:
    """Whether step 6 decodes through `CUDAGraphDecodeStep`: when asked (`Llama.build`'s default) on a CUDA device in
    one process. Under model parallelism the step holds NCCL all-reduces, which are left to eager launches."""
    return requested and device.type == "cuda" and model_parallel_size == 1


def compiles_by_default(model: nn.Module, model_parallel_size: int) -> bool:
    """Whether step 6 compiles the decode step when the caller leaves it to the runtime (`compile=None`): for
    quantized weights on one CUDA GPU. There torch.compile widens each int8 or int4 weight inside its product, where
    the eager products (graphed or not) widen into a copy first or run a kernel made for few rows, and decode
    slower (docs/cuda.md)."""
    on_one_gpu = model.tok_embeddings.weight.device.type == "cuda" and model_parallel_size == 1
    return on_one_gpu and any(is_quantized(layer) for layer in model.modules())


def replace_layers(model: nn.Module, kind, replacement) -> int:
    """Replace every submodule of `model` of type `kind` with `replacement(submodule)`, in place; return how many.
    The fairscale layer an `InferenceLayer` holds (for its settings) is not run, and is left as it is."""
    replaced = 0
    for module in list(model.modules()):
        if isinstance(module, InferenceLayer):
            continue
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, replacement(child))
                replaced += 1
    return replaced


def fuse_products(copies: int) -> FuseProducts:
    """Step 2's fused products: int8-dyn and int4-dyn layers as one ONNX Runtime session (`fused_dyn`); int8 layers
    on the CPU as one stacked weight (`stacked_int8`); float layers on the CPU's kernels as one copy, where `copies`
    (`fused_product`)."""

    def fuse(name: str, *layers: nn.Module) -> Optional[nn.Module]:
        return fused_dyn(*layers) or stacked_int8(*layers) or (fused_product(name, *layers) if copies else None)

    return fuse


def use_cpu_kernels(model: nn.Module) -> None:
    """Step 1: every fairscale linear layer of `model` becomes a `CPULinear` (on `F.linear` until step 3 chooses);
    for a model that `llama.runtime.cpu.runs_on_cpu_kernels` to."""
    replace_layers(model, LINEAR, CPULinear)


def use_parallel_layers(model: nn.Module) -> int:
    """Step 4: fairscale's linear layers and embedding become `ParallelLinear` and `ParallelEmbedding` (the same
    weights, keys and math); layers replaced already (`CPULinear`, quantized ones) stay as they are. Returns how
    many layers it replaced."""
    return replace_layers(model, LINEAR, ParallelLinear) + replace_layers(
        model, VocabParallelEmbedding, ParallelEmbedding
    )


def unpack_layers(model: nn.Module) -> None:
    """Undo steps 1 and 2, in place: fairscale's layers, as in Meta's code."""
    replace_layers(model, InferenceLayer, InferenceLayer.unpack)


def choose_cpu_kernels(model: nn.Module, copies: int, verify_rows: Optional[int] = None) -> None:
    """Step 3: each product's kernel for each row count that matters (`llama.runtime.cpu.choose_kernels`; on as many
    copies of the weights as `copies`), then the copies of the weights the chosen kernels run on."""
    counts = row_counts(model.params.max_batch_size, verify_rows)
    for layer, kernels in choose_kernels(model, counts, copies).items():
        layer.kernels = kernels
    make_weight_copies(model)


def quantize_model(model: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """Quantize every linear layer of a `Transformer` and its output head, in place; return the model.

    Works on a model built as Meta's code builds it (fairscale's layers, weights loaded) and on one whose layers
    the runtime replaced. With several model-parallel processes, call it in all of them: each quantizes its own
    slice. On a GPU, the quantized layers' products are then timed (`choose_quantized_kernels`).
    (`Llama.build(quantize=...)` quantizes each layer as it loads instead, so that the whole model is never held
    unquantized.)

    Args:
        model: The Transformer, with its weights.
        scheme: "int8" (one scale per output channel) or "int4" (groups along the input); on the CPU also
            "int8-dyn" or "int4-dyn" (with 8-bit activations, `llama.runtime.onnx_dyn`).
        group_size: int4's group size, one of 256, 128, 64 or 32 (default). A layer whose input width it does not
            divide takes the largest smaller size that does; a layer that int4 cannot hold (an input width that is
            not a multiple of 32, or outputs not a multiple of 16) is quantized to int8 instead. int8-dyn and
            int4-dyn take groups of 32 only (None or 32).

    Raises:
        ValueError: for an unknown scheme or group size, or a device PyTorch has no kernel for.
    """
    check_scheme(scheme)
    if scheme == "int4":
        check_group_size(group_size)
    elif scheme in LOAD_SCHEMES and group_size not in (None, DYN_GROUP_SIZE):
        raise ValueError(f"{scheme} takes groups of {DYN_GROUP_SIZE} only, got group_size={group_size!r}")
    weight = model.norm.weight  # in the model's dtype, on its device (the embedding may be int4)
    check_device(weight.device, scheme, weight.dtype)
    if not is_quantized(model.output):
        model.output = quantize_named_layer("output", model.output, scheme, group_size)
    replace_layers(
        model,
        (*LINEAR, ParallelLinear),
        lambda layer: layer if is_quantized(layer) else quantize_layer(layer, scheme, group_size),
    )
    choose_quantized_kernels(model, model.params.max_seq_len, model.params.max_batch_size)
    return model


# On the CPU, the step of one sequence with int8 weights is compiled with its weights frozen into it, as constants:
# inductor then multiplies each int8 weight by its C++ GEMM template, from a blocked copy it packs as it compiles,
# which reads one row's weights faster than PyTorch's int8 kernel (docs/speed.md has the figures). Only the template
# is a candidate for those products, so that no timing chooses between kernels that sum in other orders. Other batch
# sizes are not frozen: each frozen graph holds a copy of the weights of its own, and on 8 rows it was slower.
# Not through inductor's graph cache: it keys a frozen graph on its weights' shapes alone and keeps the packed
# copies with it, so another model of the same shape (a fine-tune) would decode on the first one's weights.
FROZEN_INT8_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "fx_graph_cache": False,
}


def with_code_of_its_own(fn: Callable, name: str) -> Callable:
    """A copy of `fn`, named `name`, with a code object of its own. torch.compile keeps what it compiled with the
    code of the frame it compiled, guarded on the arguments' types and shapes, not on which model they are: a graph
    holding one model's frozen weights would serve the next model of the same shape that ran the same code, and
    every step compiled in the process would count against one recompile limit (past it, torch.compile runs the
    step eagerly, silently)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compiled_step(model: RuntimeTransformer) -> DecodeStep:
    """Step 6 with `compile`: `compiled_decode_step`, announced as it compiles (`AnnouncedCompiles`). For
    `Llama.build(compile=True)` and `Llama.compile_decode_step`."""
    return AnnouncedCompiles(compiled_decode_step(model))


def compiled_decode_step(model: RuntimeTransformer) -> DecodeStep:
    """`model.decode_step` compiled by torch.compile, replayed as a CUDA graph on CUDA.

    A model that `for_runtime` made has no fairscale layer left (step 4). One put back on them (`unpack_layers`, as
    in Meta's code) is given `llama.runtime.parallel_layers`' again first, the same weights and math, and a log record
    says so: with fairscale's, the step would not compile to one graph.
    """
    if use_parallel_layers(model):
        logger.info("Compiling the decode step: fairscale's layers replaced with the runtime's parallel layers first")
    on_cuda = model.tok_embeddings.weight.is_cuda
    options = {
        "triton.cudagraphs": on_cuda,  # what mode="reduce-overhead" turns on
        "emulate_precision_casts": True,  # round bf16/fp16 intermediates where the eager path does
        # One row times a weight is a reduction that reads the weight once; searching its block sizes (seconds
        # more to compile) brings it to the memory's speed, and lets an int8 weight be widened inside the product.
        "coordinate_descent_tuning": on_cuda,
    }
    # Compiled without the inference mode that decode_step enters, which torch.compile cannot trace in a graph
    # of inference tensors with views (pytorch/pytorch#180823), and run inside it.
    # Each compiled as a function of its own (`with_code_of_its_own`), called with the model as its first argument.
    uncompiled = RuntimeTransformer.decode_step.__wrapped__
    step = torch.compile(with_code_of_its_own(uncompiled, "decode_step"), dynamic=False, options=options)
    frozen_step = None  # one sequence's step, on int8 weights frozen into it
    if not on_cuda and any(isinstance(layer, Int8Linear) for layer in model.modules()):
        frozen = with_code_of_its_own(uncompiled, "frozen_decode_step")
        frozen_step = torch.compile(frozen, dynamic=False, options={**options, **FROZEN_INT8_OPTIONS})

    def decode_step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            # A column of the batch's token table has its row stride, which changes with the table's length and
            # would compile the step again for each (contiguous() keeps it for one row); a copy's strides do not.
            tokens = tokens.clone(memory_format=torch.contiguous_format)
            # Copied here, an inference tensor whatever mode the caller made it in: the graph is guarded on that,
            # and a second graph (for the frozen step, a second copy of the weights) would be compiled for the other.
            position = position.clone()
            if frozen_step is None or tokens.shape[0] > 1:
                return step(model, tokens, position)
            # Frozen weights are taken as the graph's constants as torch.compile traces the step, before the
            # options above apply: the tracer is told so itself.
            with torch._dynamo.config.patch(prepare_freezing=True):
                return frozen_step(model, tokens, position)

    return decode_step
