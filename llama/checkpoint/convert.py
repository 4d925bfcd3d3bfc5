"""Checkpoints converted between Meta's layout, Hugging Face's and GGUF files, or quantized (`llama convert` is their
command line).

Tensors are streamed: at most one output file's worth of weights is in memory at a time (for `quantize_checkpoint`,
the quantized weights and one layer in floating point). The output is written to a temporary folder and renamed
when complete, so an interrupted run never looks finished.
"""

import base64
import json
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from safetensors.torch import save_file

from llama.checkpoint import (
    LINEAR_LAYERS,
    META_PARAMS,
    CheckpointReader,
    atomic_output_dir,
    check_model_parallel_size,
    check_new_output_dir,
    find_tokenizer,
    full_shapes,
    hf_config,
    meta_to_hf_name,
    model_args_from,
    open_checkpoint,
    permute_for_rotate_half,
    rank_weights,
    save_shard,
    saved_quantization,
    split_dim,
    write_meta_checkpoint,
)
from llama.checkpoint.gguf_file import GGUFCheckpoint
from llama.checkpoint.gguf_write import GGUF_TYPES, write_gguf
from llama.checkpoint.hf_mllama import MllamaWriter
from llama.checkpoint.load import check_vision_model_parallel_size
from llama.checkpoint.quantized import SAVED_DTYPE, quantize_for_saving, saved_shapes
from llama.checkpoint.report import weights_bar
from llama.quantize import check_group_size, check_scheme
from llama.tokenizer.gguf_vocab import is_gguf_file
from llama.vision.model import holds_vision_model, vision_args_from


def meta_to_hf(src: Path, out_dir: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a Hugging Face folder (config.json, model-*.safetensors, index) for a Meta checkpoint or a GGUF file
    (whose q and k rows are in Meta's order too): a LlamaForCausalLM folder, or for Llama 3.2 Vision an
    MllamaForConditionalGeneration one (`llama.checkpoint.hf_mllama`)."""
    reader = open_checkpoint(src)
    if reader.format == "hf":
        raise ValueError(f"{src} is a Hugging Face checkpoint already; did you mean `to-meta`?")
    if saved_quantization(reader.params, src / META_PARAMS):
        raise ValueError(
            f"{src} holds quantized weights, which Hugging Face's layout has no place for; convert the "
            "floating-point checkpoint it was made from"
        )
    args, _ = model_args_from(reader.params)
    if vision_args_from(reader.params, args.n_layers) is not None:
        writer = MllamaWriter(reader, reader.dtype)
        config, shapes, make = writer.config, writer.shapes, writer.tensor
    else:
        tied = "output.weight" not in reader.shapes
        params = dict(reader.params, **({"tie_word_embeddings": True} if tied else {}))
        config = hf_config(params, reader.dtype)
        keys = {meta_to_hf_name(key): key for key in reader.shapes}  # HF name -> Meta key
        shapes = {name: reader.shapes[key] for name, key in keys.items()}

        def make(name: str) -> torch.Tensor:
            tensor = read_full(reader, keys[name])
            if keys[name].endswith(("attention.wq.weight", "attention.wk.weight")):
                tensor = permute_for_rotate_half(tensor, tensor.shape[0] // args.head_dim)
            return tensor.contiguous()

    with atomic_output_dir(out_dir) as tmp_dir:
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        groups = list(group_by_size(shapes, reader.dtype, max_shard_bytes))
        weight_map, total_bytes = {}, 0
        for index, names in enumerate(groups):
            file_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for name in weights_bar(names, len(names), rank=0, what=f"Writing {file_name}"):
                tensors[name] = make(name)
                weight_map[name] = file_name
                total_bytes += tensors[name].numel() * tensors[name].element_size()
            save_file(tensors, tmp_dir / file_name, metadata={"format": "pt"})
            # safetensors creates its files readable by their owner only; give them config.json's permissions.
            shutil.copymode(tmp_dir / "config.json", tmp_dir / file_name)
            print(f"[{index + 1}/{len(groups)}] wrote {file_name} ({len(names)} tensors)", flush=True)
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
        copy_tokenizer(src, tmp_dir, reader)


def hf_to_meta(src: Path, out_dir: Path, model_parallel_size: int = 1) -> None:
    """Write a Meta folder (params.json, consolidated.NN.pth) for a Hugging Face checkpoint or a GGUF file (its
    quantized tensors dequantized, in float32: exactly the values llama.cpp computes with)."""
    reader = floating_point(open_checkpoint(src))
    if reader.format == "meta":
        raise ValueError(f"{src} is a Meta checkpoint already; did you mean `to-hf`?")
    args, _ = model_args_from(reader.params)
    check_model_parallel_size(args, model_parallel_size, setting="--model_parallel_size")
    vision = vision_args_from(reader.params, args.n_layers)
    if vision is not None:
        check_vision_model_parallel_size(vision, model_parallel_size)
    # A vision model's own encoder fields (vision_encoder_*) are there only when its encoder is not Meta's size.
    params = {k: v for k, v in reader.params.items() if k != "tie_word_embeddings"}
    with atomic_output_dir(out_dir) as tmp_dir:
        (tmp_dir / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        for rank in range(model_parallel_size):
            keys = weights_bar(reader.shapes, len(reader.shapes), rank=0, what=f"Writing shard {rank}")
            shard = {key: reader.read_shard(key, rank, model_parallel_size) for key in keys}
            save_shard(shard, tmp_dir / f"consolidated.{rank:02d}.pth")
            print(f"[{rank + 1}/{model_parallel_size}] wrote consolidated.{rank:02d}.pth", flush=True)
            del shard
        copy_tokenizer(src, tmp_dir, reader)


def quantize_checkpoint(
    src: Path, out_dir: Path, scheme: str, group_size: Optional[int] = None, model_parallel_size: int = 1
) -> None:
    """Write a Meta folder of `src` (Meta or Hugging Face) with its linear layers and output head quantized, for
    `Llama.build` to load as stored (see `llama.quantize`); params.json records the scheme under "quantization"."""
    check_scheme(scheme)
    group_size = check_group_size(group_size) if scheme == "int4" else None
    src, out_dir = Path(src), check_new_output_dir(out_dir)
    reader = open_checkpoint(src)
    if saved_quantization(reader.params, src / META_PARAMS):
        raise ValueError(f"{src} is already quantized; quantize the floating-point checkpoint it was made from")
    refuse_vision(reader.params, src, "quantized once; Llama.build(quantize=...) quantizes its text model as it loads")
    args, _ = model_args_from(reader.params)
    check_model_parallel_size(args, model_parallel_size, setting="--model_parallel_size")
    shapes = full_shapes(args)
    linear_keys = [key for key in shapes if key.split(".")[-2] in LINEAR_LAYERS]
    for key in linear_keys:  # a split that cuts int4 groups is refused before any work is done
        saved_shapes(*shapes[key], split_dim(key) == 1, scheme, group_size, model_parallel_size)
    tensors = {}
    expected = {key: torch.Size(shape) for key, shape in shapes.items()}
    cpu = torch.device("cpu")
    # Keys and shapes checked against params.json first; a tied head comes as the embedding.
    weights = weights_bar(rank_weights(reader, expected, 0, 1, SAVED_DTYPE, cpu), len(expected), 0, what="Quantizing")
    for index, (key, tensor) in enumerate(weights):
        if key in linear_keys:
            name = key.removesuffix(".weight")
            tensors.update({f"{name}.{f}": t for f, t in quantize_for_saving(tensor, scheme, group_size).items()})
            print(f"[{index + 1}/{len(shapes)}] quantized {key} {tuple(tensor.shape)}", flush=True)
        else:
            tensors[key] = tensor
    params = {k: v for k, v in reader.params.items() if k != "tie_word_embeddings"}  # the head is stored
    params["quantization"] = {"scheme": scheme, **({"group_size": group_size} if group_size else {})}
    write_meta_checkpoint(out_dir, params, tensors, model_parallel_size)
    copy_tokenizer(src, out_dir)
    source_bytes = sum(shape.numel() for shape in reader.shapes.values()) * reader.dtype.itemsize
    quantized_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"Weights: {source_bytes / 2**20:.0f} MiB in {src}, {quantized_bytes / 2**20:.0f} MiB quantized")


def read_full(reader, key: str) -> torch.Tensor:
    return reader.read_shard(key, 0, 1)


def group_by_size(shapes: Dict[str, torch.Size], dtype: torch.dtype, max_bytes: int) -> Iterator[List[str]]:
    """Consecutive keys in groups of at most `max_bytes` (a single larger tensor gets a group of its own)."""
    group, size = [], 0
    element_size = torch.empty(0, dtype=dtype).element_size()
    for key, shape in shapes.items():
        nbytes = shape.numel() * element_size
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group


def copy_tokenizer(src: Path, out_dir: Path, checkpoint: Optional[CheckpointReader] = None) -> Optional[Path]:
    """Copy the checkpoint's tokenizer.model along, if it has one; a GGUF file's vocabulary is written as one (read
    through `checkpoint`'s reader, where it is open)."""
    out = out_dir / "tokenizer.model"
    if is_gguf_file(src):
        gguf = checkpoint if checkpoint is not None and checkpoint.format == "gguf" else GGUFCheckpoint(src)
        if not gguf.has_vocabulary:
            return None
        ranks = gguf.vocabulary()
        out.write_bytes(b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items()))
        return out
    try:
        return Path(shutil.copy(find_tokenizer(src), out))
    except FileNotFoundError:
        return None


def floating_point(reader: CheckpointReader) -> CheckpointReader:
    """`reader`, or for a 4-bit GGUF file (which reads as int4) the same file with every layer dequantized."""
    if reader.format == "gguf" and reader.int4_layers:
        return GGUFCheckpoint(reader.path, keep_int4=False)
    return reader


def refuse_vision(params: dict, src: Path, what_not: str) -> None:
    """A ValueError for a Llama 3.2 Vision checkpoint where a conversion takes text models only."""
    if holds_vision_model(params):
        raise ValueError(f"{src} is a Llama 3.2 Vision model, which cannot be {what_not}")


def to_gguf(src: Path, out: Path, file_type: str = "BF16") -> None:
    """Write a Meta or Hugging Face checkpoint (or a GGUF file: dequantized, without a vocabulary) as the GGUF file
    `out`, its matrices in `file_type` (one of `GGUF_TYPES`), with its tokenizer.model's vocabulary where it has
    one. llama.cpp's `llama-quantize` makes the other quantized types from it."""
    if file_type not in GGUF_TYPES:
        raise ValueError(f"--type must be one of {', '.join(GGUF_TYPES)}, got {file_type!r}")
    src, out = Path(src), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new file name or remove it")
    reader = floating_point(open_checkpoint(src))
    if saved_quantization(reader.params, src / META_PARAMS):
        raise ValueError(f"{src} holds this project's quantized weights; convert the floating-point checkpoint")
    refuse_vision(reader.params, src, "written as GGUF (llama.cpp runs no Llama 3.2 Vision)")
    try:
        tokenizer_path = None if reader.format == "gguf" else find_tokenizer(src)
    except FileNotFoundError:
        tokenizer_path = None  # a file without a vocabulary: llama.cpp then needs token IDs
    partial, what = out.with_name(out.name + ".partial"), f"Writing {out.name}"
    try:
        write_gguf(reader, tokenizer_path, partial, file_type, lambda names: weights_bar(names, len(names), 0, what))
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
