"""The load sequence of `Llama.build`: open a checkpoint folder, check the arguments against it, and build the
`Transformer` with this rank's weights."""

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import fairscale.nn.model_parallel.initialize as fs_init
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch.utils._python_dispatch import TorchDispatchMode

from llama.arguments import short_repr
from llama.checkpoint.gguf_file import GGUFCheckpoint
from llama.checkpoint.hf_mllama import open_hf_folder
from llama.checkpoint.locate import checkpoint_path, is_ollama_name
from llama.checkpoint.meta import MetaCheckpoint
from llama.checkpoint.params import (
    BUILD_FIELDS,
    HF_CONFIG,
    META_PARAMS,
    checked_int,
    model_args_from,
    saved_quantization,
)
from llama.checkpoint.quantized import layer_from_saved, saved_shapes
from llama.checkpoint.report import FORMAT_NAMES, LoadReport, weights_bar
from llama.checkpoint.shards import CheckpointReader, check_model_parallel_size, rank_weights
from llama.distributed import (
    free_memory,
    global_rank,
    init_model_parallel,
    resolve_device,
    resolve_dtype,
)
from llama.model import ModelArgs, Transformer
from llama.os_memory import release_freed_memory
from llama.quantize import check_device, check_scheme, whole_shape
from llama.runtime.cuda_graphs import decode_step_bytes
from llama.runtime.quantized import quantize_layer
from llama.tokenizer import Tokenizer, files
from llama.tokenizer.gguf_vocab import is_gguf_file
from llama.vision.model import LEARNABLE_EMBEDDINGS, CrossAttentionTransformer, VisionArgs, vision_args_from

logger = logging.getLogger(__name__)


def open_checkpoint(ckpt_dir) -> CheckpointReader:
    """Open a Meta (params.json) or Hugging Face (config.json) checkpoint folder, or a GGUF file (also named as
    `llama.checkpoint.locate` reads names: an ollama model, a folder that holds one GGUF file)."""
    if not isinstance(ckpt_dir, (str, os.PathLike)):
        raise ValueError(f"ckpt_dir must be the path of a checkpoint folder, got {short_repr(ckpt_dir)}")
    ckpt_dir = checkpoint_path(ckpt_dir)
    if is_gguf_file(ckpt_dir) or (ckpt_dir.is_file() and ckpt_dir.suffix == ".gguf"):
        return GGUFCheckpoint(ckpt_dir)  # a file named .gguf that is not one is told so there
    if ckpt_dir.is_file():
        raise ValueError(
            f"{ckpt_dir} is a file, and not a GGUF file; pass the folder that holds it (ckpt_dir={ckpt_dir.parent})"
        )
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"Checkpoint directory {ckpt_dir} does not exist")
    if (ckpt_dir / META_PARAMS).is_file():
        return MetaCheckpoint(ckpt_dir)
    if (ckpt_dir / HF_CONFIG).is_file():
        return open_hf_folder(ckpt_dir)  # a text Llama's, or a Llama 3.2 Vision's (Mllama)
    raise FileNotFoundError(
        f"{ckpt_dir} has no params.json (Meta layout) and no config.json (Hugging Face layout); "
        "point ckpt_dir at the folder that holds the checkpoint"
    )


def find_tokenizer(ckpt_dir, tokenizer_path: Optional[str] = None) -> str:
    """The tokenizer file: `tokenizer_path` if given, else tokenizer.model in ckpt_dir or ckpt_dir/original (a GGUF
    file is its own).

    Raises:
        FileNotFoundError: when tokenizer_path is None and neither folder holds a tokenizer.model.
    """
    if tokenizer_path is not None:
        return str(tokenizer_path)  # checked as it is read
    if is_ollama_name(ckpt_dir) or os.path.exists(ckpt_dir):
        located = checkpoint_path(ckpt_dir)
        if is_gguf_file(located):
            return str(located)  # its vocabulary is inside
    candidates = [files.join(str(ckpt_dir), name) for name in ("tokenizer.model", "original/tokenizer.model")]
    for candidate in candidates:
        if files.exists(candidate) and not files.isdir(candidate):
            return candidate
    raise FileNotFoundError(f"No tokenizer.model found (looked at {', '.join(candidates)}); pass tokenizer_path")


class AllocateOnMeta(TorchDispatchMode):
    """Inside it, every tensor is created on the meta device: no memory, no initialisation.

    `with torch.device("meta")` is not enough: fairscale allocates its weights with the legacy `torch.Tensor(rows,
    cols)` constructor, which ignores it. That allocation still reaches the dispatcher as a factory op with a
    device argument, which this mode replaces. Like every dispatch mode it is local to the thread that enters it
    and ends with the block.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing in this mode is compiled. Left True, PyTorch wraps `__torch_dispatch__` in dynamo's disable, which
        # imports torch._dynamo at the first tensor made: about 2 s of every load.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs and "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return func(*args, **(kwargs or {}))


def load_model(
    reader: CheckpointReader,
    model_args: ModelArgs,
    mp_rank: int,
    mp_size: int,
    device: torch.device,
    dtype: torch.dtype,
    quantize: Optional[str] = None,
    group_size: Optional[int] = None,
    bar_rank: Optional[int] = None,
    vision: Optional[VisionArgs] = None,
) -> Union[Transformer, CrossAttentionTransformer]:
    """The Transformer with this rank's weights, as Meta's code builds it (fairscale's layers), without a throwaway
    random initialisation: built on the meta device, then given the checkpoint's tensors, strictly.

    With `quantize`, each linear layer is quantized as soon as its weight is read (`llama.quantize`), so that at
    most one layer's weight is held in `dtype` at a time. A quantized checkpoint (its params.json has
    "quantization") gives its layers as they are stored, and `quantize` must then be its scheme or None; the
    layers it keeps in floating point (`reader.float_layers`) load as they are.
    """
    check_model_parallel_size(model_args, mp_size, len(reader.files) if isinstance(reader, MetaCheckpoint) else None)
    saved = saved_quantization(reader.params, reader.ckpt_dir / META_PARAMS)
    if saved:
        check_quantize_matches(quantize, saved[0], reader.ckpt_dir)
        quantize, group_size = saved
    if vision is not None:
        check_vision_model_parallel_size(vision, mp_size)
    with AllocateOnMeta():
        model = CrossAttentionTransformer(model_args, vision) if vision else Transformer(model_args)
    expected_shapes = {key: tensor.shape for key, tensor in model.state_dict().items()}
    linear = (ColumnParallelLinear, RowParallelLinear)
    # name -> stored shapes, of the layers quantization applies to: a vision model's text model's (not its encoder's)
    stored = {
        name: {}
        for name, m in model.named_modules()
        if isinstance(m, linear) and (vision is None or name.startswith("text_model."))
    }
    if saved:
        for name in set(stored) - reader.float_layers:
            layer = model.get_submodule(name)
            stored[name] = saved_shapes(*whole_shape(layer), isinstance(layer, RowParallelLinear), *saved, mp_size)
        if "tok_embeddings.scales" in reader.shapes:  # an embedding table stored in int4 (a 4-bit GGUF's)
            stored["tok_embeddings"] = saved_shapes(model_args.vocab_size, model_args.dim, False, *saved, mp_size)
        expected_shapes = with_quantized_shapes(expected_shapes, stored)
    # The embedding and the head first: the largest tensors, each made through temporaries of its size (a quantized
    # layer's), are read while the least else is held.
    first = ("tok_embeddings.", "output.")
    expected_shapes = dict(sorted(expected_shapes.items(), key=lambda item: not item[0].startswith(first)))
    weights, parts = {}, {}
    weights_read = rank_weights(reader, expected_shapes, mp_rank, mp_size, dtype, device)
    for key, tensor in weights_bar(weights_read, len(expected_shapes), bar_rank):
        name, _, field = key.rpartition(".")
        if stored.get(name):  # a quantized checkpoint's layer, built once all its stored tensors are read
            parts.setdefault(name, {})[field] = tensor
            if len(parts[name]) == len(stored[name]):
                model.set_submodule(name, layer_from_saved(model.get_submodule(name), **parts.pop(name)))
        elif name in stored and quantize and not saved:
            layer = model.get_submodule(name)
            layer.weight = torch.nn.Parameter(tensor, requires_grad=False)
            model.set_submodule(name, quantize_layer(layer, quantize, group_size))
            # The file pages its weight was read from (a quantized checkpoint's layer may still read them: kept).
            reader.forget_read_pages()
        else:
            weights[key] = tensor
            continue
        release_freed_memory()  # the temporaries a quantized layer was made through
    model.load_state_dict(weights, strict=not quantize, assign=True)
    model.init_kv_caches(device, dtype)
    return model.eval()


def with_quantized_shapes(float_shapes: Dict[str, torch.Size], stored: Dict[str, dict]) -> Dict[str, torch.Size]:
    """`float_shapes` (a state dict's shapes) with each linear layer's weight replaced by the tensors a quantized
    checkpoint stores for it (`stored`: layer name -> tensor name -> shape), in the same order."""
    shapes = {}
    for key, shape in float_shapes.items():
        name = key.removesuffix(".weight")
        if stored.get(name):
            shapes.update({f"{name}.{field}": field_shape for field, field_shape in stored[name].items()})
        else:
            shapes[key] = shape
    return shapes


def load_checkpoint(
    ckpt_dir,
    tokenizer_path: Optional[str],
    max_seq_len: int,
    max_batch_size: int,
    model_parallel_size: Optional[int],
    seed: int,
    device: Union[str, torch.device, None],
    dtype: Union[str, torch.dtype, None],
    version: Optional[str],
    timeout: timedelta,
    quantize: Optional[str] = None,
    text_only: Optional[str] = None,
) -> Tuple[Transformer, Tokenizer, LoadReport]:
    """The load sequence of `Llama.build` (see its docstring for the arguments): check the arguments against the
    checkpoint, join the process group, seed, read the tokenizer and this rank's weights (quantized, if asked, with
    the int8 products' kernels chosen). The report says what was chosen, and how long this took. `text_only`: where
    the caller needs a text model, the ValueError's message for a Llama 3.2 Vision checkpoint, raised before any
    weight is read."""
    if tokenizer_path is not None and not isinstance(tokenizer_path, (str, os.PathLike)):
        raise ValueError(
            f"tokenizer_path must be the path of a tokenizer.model file or None, got {short_repr(tokenizer_path)}"
        )
    max_seq_len = checked_int("max_seq_len", max_seq_len, 1)
    max_batch_size = checked_int("max_batch_size", max_batch_size, 1)
    if model_parallel_size is not None:
        model_parallel_size = checked_int("model_parallel_size", model_parallel_size, 1)
    seed = checked_int("seed", seed, -(2**63), 2**64 - 1)  # what torch.manual_seed takes
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {short_repr(timeout)}")
    # Each step once, in order: what the checkpoint holds, where it runs, its tokenizer, the weights.
    reader = open_checkpoint(ckpt_dir)
    model_args, ignored = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    vision = vision_args_from(reader.params, model_args.n_layers)
    if vision is not None and text_only is not None:
        raise ValueError(text_only)
    if max_seq_len > model_args.context_len:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds this checkpoint's context of {model_args.context_len} tokens"
        )
    device = resolve_device(device)
    tokenizer_path = find_tokenizer(ckpt_dir, tokenizer_path)
    saved = saved_quantization(reader.params, reader.ckpt_dir / META_PARAMS)
    if saved:
        check_quantize_matches(quantize, saved[0], ckpt_dir)
        if quantize is not None:  # asked for by name: what the checkpoint keeps in other forms is quantized too
            reader.requantize()
        quantize = saved[0]
    if quantize is not None and dtype is None and device.type == "cpu":
        dtype = torch.bfloat16  # what the CPU's weight-only kernels run fastest with
    dtype = resolve_dtype(reader.dtype if dtype is None and reader.format in ("hf", "gguf") else dtype, device)
    if quantize is not None:
        check_scheme(quantize)
        check_device(device, quantize, dtype)

    start_time = time.time()
    model_parallel_size = init_model_parallel(device, model_parallel_size, timeout)
    rank = global_rank()  # its weights bar: rank 0's
    torch.manual_seed(seed)  # the same in all processes: they must sample the same tokens
    logger.info("Loading a %s checkpoint from %s", FORMAT_NAMES[reader.format], ckpt_dir)
    if ignored:
        logger.warning(
            "Ignoring checkpoint parameters %s: unknown to the model, or (%s) set by Llama.build's arguments",
            ignored,
            ", ".join(BUILD_FIELDS),
        )
    check_kv_cache_fits(model_args, model_parallel_size, device, dtype)
    version = version or ("3.1" if model_args.use_scaled_rope else "3")
    ranks = reader.vocabulary() if reader.format == "gguf" and Path(tokenizer_path) == reader.path else None
    tokenizer = Tokenizer(tokenizer_path, version=version, ranks=ranks)  # a GGUF's vocabulary read once, above
    if model_args.vocab_size != tokenizer.n_words:
        raise ValueError(
            f"The checkpoint's vocab_size ({model_args.vocab_size}) differs from the tokenizer's "
            f"({tokenizer.n_words} tokens in {tokenizer_path}); use the tokenizer.model that came with it"
        )
    mp_rank = fs_init.get_model_parallel_rank()
    model = load_model(
        reader, model_args, mp_rank, model_parallel_size, device, dtype, quantize, bar_rank=rank, vision=vision
    )
    seconds = time.time() - start_time
    report = LoadReport(
        reader.format, device, dtype, quantize, bool(saved), model_parallel_size, seconds, reader.load_note()
    )
    report.vision = vision is not None
    return model, tokenizer, report


def check_vision_model_parallel_size(vision: VisionArgs, mp_size: int) -> None:
    """Raise a ValueError when a vision model's encoder heads or image-token embeddings cannot be split `mp_size`
    ways (its text model is checked as any text model is)."""
    if vision.encoder.heads % mp_size or LEARNABLE_EMBEDDINGS % mp_size:
        raise ValueError(
            f"This vision model cannot be split over {mp_size} model-parallel processes: its encoder's "
            f"{vision.encoder.heads} heads and its {LEARNABLE_EMBEDDINGS} image-token embeddings must divide evenly; "
            "change --nproc_per_node (or model_parallel_size)"
        )


def check_quantize_matches(quantize: Optional[str], saved_scheme: str, ckpt_dir) -> None:
    if quantize not in (None, saved_scheme):
        raise ValueError(
            f"{ckpt_dir} holds weights quantized as {saved_scheme}; they cannot be loaded as {quantize}. Pass "
            f"quantize={saved_scheme!r} or leave it out, or convert the floating-point checkpoint to {quantize}"
        )


def check_kv_cache_fits(args: ModelArgs, mp_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a ValueError, before anything is allocated, when this process's KV cache cannot fit on `device`. On
    CUDA the activations of a decode step at the whole batch count too: a recorded CUDA graph keeps them."""
    elements = 2 * args.n_layers * args.max_batch_size * args.max_seq_len * (args.kv_heads // mp_size) * args.head_dim
    needed = elements * torch.empty(0, dtype=dtype).element_size()
    what = "The KV cache"
    if device.type == "cuda":
        needed += decode_step_bytes(args, mp_size, dtype)
        what = "The KV cache and a decode step's activations"
    free = free_memory(device)
    if free is not None and needed > free:
        raise ValueError(
            f"{what} for max_seq_len={args.max_seq_len} and max_batch_size={args.max_batch_size} needs "
            f"{needed / 2**30:.1f} GiB on {device}, which has {free / 2**30:.1f} GiB free; lower max_batch_size or "
            "max_seq_len"
        )
