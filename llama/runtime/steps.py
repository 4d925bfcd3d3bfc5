"""The one place where a loaded reference `Transformer` becomes the model that runs here (`for_runtime`), in named
steps, in order. Nothing else in the package replaces a model's layers or sets attributes on them.
"""

import functools
import logging
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Tuple, Union

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from torch import nn

from llama.distributed import free_memory, global_rank
from llama.model import Transformer
from llama.quantize import check_device, check_group_size, check_scheme
from llama.runtime.compiled import AnnouncedCompiles
from llama.runtime.cpu.kernels import one_position_attention, onednn_supported
from llama.runtime.cpu.layers import CPULinear
from llama.runtime.cuda_graphs import CUDAGraphDecodeStep
from llama.runtime.kernel_table import ROW_CLASSES, cpu_offers, matmul_attention_from, pinned_kernel, table_kernels
from llama.runtime.parallel_layers import (
    InferenceLayer,
    KernelLinear,
    ParallelEmbedding,
    ParallelLinear,
    kernels_in_use,
)
from llama.runtime.quantized import Int8Linear, is_quantized, quantize_layer
from llama.runtime.stacked import Stack, stacked
from llama.runtime.transformer import DecodeStep, RuntimeTransformer
from llama.runtime.vision import RuntimeVisionText
from llama.vision.model import CrossAttentionTransformer

LINEAR = (ColumnParallelLinear, RowParallelLinear)
logger = logging.getLogger(__name__)


def for_runtime(
    model: Union[Transformer, CrossAttentionTransformer],
    *,
    compile: Optional[bool] = False,
    cuda_graphs: bool = False,
    model_parallel_size: int = 1,
) -> Tuple[RuntimeTransformer, Optional[DecodeStep]]:
    """The runtime form of a loaded `Transformer` (quantized as it loaded, or not) and the decode step to run it
    with (None: eagerly, `RuntimeTransformer.decode_step` or `forward`). The same weights and math throughout; each
    step keeps the logits of the reference's algorithm, up to the order of float32 sums (tested).

    1. `use_cpu_kernels`: on the CPU (`runs_on_cpu_kernels`), each fairscale linear layer becomes a `CPULinear`.
    2. `RuntimeTransformer`: the runtime modules (`llama.runtime.transformer`): the fixed-shape decode step, per-row
       positions and cache rows for the engine, layers of one input stacked into one product on the CPU where their
       kernel reads a float16 or fbgemm int8 copy (`llama.runtime.stacked`), and on the CPU float32 matmuls for one
       new position's bfloat16 attention from the cache length the kernel table gives (`attention_kernel`).
       A Llama 3.2 Vision model's text model becomes `RuntimeVisionText` (`llama.runtime.vision`), in place of
       `model.text_model`, and its vision encoder runs as the reference's (steps 1, 3 and 4 are the text model's).
    3. `use_parallel_layers`: every fairscale layer left (all of them off the CPU) becomes `ParallelLinear` or
       `ParallelEmbedding`: the collectives called directly and skipped in one process, traceable by torch.compile.
    4. `use_table_kernels`: each `KernelLinear` (the CPU's float layers, the quantized ones) runs the kernel table's
       kernel for each row class, and the copies of the weights those kernels read are made, where memory holds them.
    5. The decode step: compiled with torch.compile if asked (`compiled_decode_step`; `compile=None` asks where
       `compiles_by_default`), else on one CUDA GPU replayed as CUDA graphs where `cuda_graphs` (`use_cuda_graphs`,
       `CUDAGraphDecodeStep`).

    A vision model's images change from call to call and decide which rows run each cross-attention block, so its
    steps run eagerly: it is neither compiled nor replayed as CUDA graphs (the caller refuses `compile`).

    Nothing is timed: the kernels depend only on the device, the weights and each call's row count.
    """
    vision = isinstance(model, CrossAttentionTransformer)
    text = model.text_model if vision else model
    if runs_on_cpu_kernels(text):
        use_cpu_kernels(text)
    kernel = attention_kernel(text)
    runtime = RuntimeVisionText(model, kernel, stacked) if vision else RuntimeTransformer(text, kernel, stacked)
    use_parallel_layers(runtime)
    use_table_kernels(runtime)
    runtime.kernels_in_use = kernels_in_use(runtime)  # what the load report says of the choices
    if vision:
        model.text_model = runtime
        return runtime, None
    if compile is None and compiles_by_default(runtime, model_parallel_size):
        logger.info("Quantized weights on CUDA: the decode step will be compiled (compile=False replays CUDA graphs)")
        compile = True
    if compile:
        return runtime, compiled_step(runtime)
    if use_cuda_graphs(runtime.tok_embeddings.weight.device, model_parallel_size, cuda_graphs):
        return runtime, CUDAGraphDecodeStep(runtime)
    return runtime, None


def use_cuda_graphs(device: torch.device, model_parallel_size: int, requested: bool) -> bool:
    """Whether step 5 decodes through `CUDAGraphDecodeStep`: when asked (`Llama.build`'s default) on a CUDA device in
    one process. Under model parallelism the step holds NCCL all-reduces, which are left to eager launches."""
    return requested and device.type == "cuda" and model_parallel_size == 1


def compiles_by_default(model: nn.Module, model_parallel_size: int) -> bool:
    """Whether step 5 compiles the decode step when the caller leaves it to the runtime (`compile=None`): for
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


def runs_on_cpu_kernels(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can run on the CPU's kernels (`CPULinear`): on the CPU, in float32 or
    bfloat16, with a torch build that has oneDNN."""
    weight = model.norm.weight  # in the model's dtype, on its device (the embedding may be int4)
    return onednn_supported(weight.device) and weight.dtype in (torch.float32, torch.bfloat16)


def use_cpu_kernels(model: nn.Module) -> None:
    """Step 1: every fairscale linear layer of `model` becomes a `CPULinear` (on `F.linear` until step 4)."""
    replace_layers(model, LINEAR, CPULinear)


def attention_kernel(model: nn.Module) -> Optional[Callable]:
    """Step 2's kernel for one new position's attention: `one_position_attention` from the cache length the kernel
    table gives this CPU, for a bfloat16 model on the CPU; else None (SDPA's kernel)."""
    weight = model.norm.weight
    start = matmul_attention_from() if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 else None
    return None if start is None else functools.partial(one_position_attention, from_positions=start)


def use_parallel_layers(model: nn.Module) -> int:
    """Step 3: fairscale's linear layers and embedding become `ParallelLinear` and `ParallelEmbedding` (the same
    weights, keys and math); layers replaced already (`CPULinear`, quantized ones) stay as they are. Returns how
    many layers it replaced."""
    return replace_layers(model, LINEAR, ParallelLinear) + replace_layers(
        model, VocabParallelEmbedding, ParallelEmbedding
    )


def unpack_layers(model: nn.Module) -> None:
    """Undo steps 1 and 3, in place: fairscale's layers, as in Meta's code."""
    replace_layers(model, InferenceLayer, InferenceLayer.unpack)


def use_table_kernels(model: nn.Module) -> None:
    """Step 4: each `KernelLinear` of `model` runs the kernel table's kernel for each row class
    (`llama.runtime.kernel_table`; on the CPU `LLAMA_CPU_KERNEL` pins one), or PyTorch's own where the table has no
    row for it or its kernel cannot run the layer; then the copies of the weights those kernels read (float16,
    oneDNN's layout, fbgemm's int8) are made, on as many threads as torch uses (fbgemm packs on one core). Where the
    copies would take more than half the memory available, none is made, and those layers run PyTorch's kernel."""
    layers: List[KernelLinear] = [layer for layer in model.modules() if isinstance(layer, KernelLinear)]
    stacks = [module for module in model.modules() if isinstance(module, Stack)]
    known = {kernel for layer in layers for kernel in layer.KERNELS}
    pinned = pinned_kernel(known) if layers and layers[0].weight.device.type == "cpu" else None
    for layer in layers:
        wanted = table_kernels(layer.weight.device, layer.weights())
        if pinned is not None and pinned in layer.KERNELS:
            wanted = (pinned,) * len(ROW_CLASSES)
        default = layer.default_kernel()
        layer.kernels = tuple(
            kernel if layer.runs(kernel) else default for kernel in wanted or [default] * len(ROW_CLASSES)
        )
    copy_bytes = sum(layer.copy_bytes() for layer in layers)
    # Memory that cannot be measured holds no copies (`llama.os_memory.available_memory`).
    available = (free_memory(layers[0].weight.device) or 0) if copy_bytes else 0
    if copy_bytes and 2 * copy_bytes > available:
        logger.warning(
            "No copies of the weights for the CPU's kernels: they would take %.1f GB, more than half the %.1f GB "
            "available; those layers run PyTorch's own kernels",
            copy_bytes / 1e9,
            available / 1e9,
        )
        for layer in layers:
            if layer.copy_bytes():
                layer.kernels = (layer.default_kernel(),) * len(ROW_CLASSES)
    for stack in stacks:
        stack.claim()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # a stack makes the copy of its layers, stacked
        list(pool.map(lambda layer: layer.make_copies(), layers + stacks))
    if layers and layers[0].weight.device.type == "cpu" and global_rank() == 0:
        logger.info("CPU: %s; kernels by row class: %s", cpu_offers(), kernels_in_use(model))


def quantize_model(model: nn.Module, scheme: str, group_size: Optional[int] = None) -> nn.Module:
    """Quantize every linear layer of a `Transformer` and its output head, in place; return the model.

    Works on a model built as Meta's code builds it (fairscale's layers, weights loaded) and on one whose layers
    the runtime replaced. With several model-parallel processes, call it in all of them: each quantizes its own
    slice. The quantized layers then run the kernel table's kernels (`use_table_kernels`).
    (`Llama.build(quantize=...)` quantizes each layer as it loads instead, so that the whole model is never held
    unquantized.)

    Args:
        model: The Transformer, with its weights.
        scheme: "int8" (one scale per output channel) or "int4" (groups along the input).
        group_size: int4's group size, one of 256, 128, 64 or 32 (default). A layer whose input width it does not
            divide takes the largest smaller size that does; a layer that int4 cannot hold (an input width that is
            not a multiple of 32, or outputs not a multiple of 16) is quantized to int8 instead.

    Raises:
        ValueError: for an unknown scheme or group size, or a device PyTorch has no kernel for.
    """
    check_scheme(scheme)
    if scheme == "int4":
        check_group_size(group_size)
    weight = model.norm.weight  # in the model's dtype, on its device (the embedding may be int4)
    check_device(weight.device, scheme, weight.dtype)
    if not is_quantized(model.output):
        model.output = quantize_layer(model.output, scheme, group_size)
    replace_layers(
        model,
        (*LINEAR, ParallelLinear),
        lambda layer: layer if is_quantized(layer) else quantize_layer(layer, scheme, group_size),
    )
    use_table_kernels(model)
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
