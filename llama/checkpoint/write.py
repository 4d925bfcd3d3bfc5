"""Writing Meta checkpoints: params.json and consolidated.NN.pth, into a folder that appears only when complete."""

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator

import torch

from llama.checkpoint.params import META_PARAMS, model_args_from
from llama.checkpoint.shards import check_model_parallel_size, split_dim


def check_new_output_dir(out_dir) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists and is not empty; choose a new output folder")
    return out_dir


@contextmanager
def atomic_output_dir(out_dir) -> Iterator[Path]:
    """Write into a temporary sibling folder and rename it to `out_dir` only once everything is written,
    so a half-written folder never looks like a finished checkpoint."""
    out_dir = check_new_output_dir(out_dir)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        yield tmp_dir
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    tmp_dir.rename(out_dir)


def write_meta_checkpoint(out_dir, params: dict, tensors: Dict[str, torch.Tensor], n_shards: int = 1) -> None:
    """Write params.json and consolidated.NN.pth, split over `n_shards` the way fairscale shards them."""
    check_model_parallel_size(model_args_from(params)[0], n_shards)
    with atomic_output_dir(out_dir) as tmp_dir:
        (tmp_dir / META_PARAMS).write_text(json.dumps(params, indent=2) + "\n")
        for rank in range(n_shards):
            shard = {}
            for key, tensor in tensors.items():
                dim = split_dim(key)
                replicated = dim is None or dim >= tensor.ndim
                shard[key] = tensor if replicated else tensor.chunk(n_shards, dim=dim)[rank]
            save_shard(shard, tmp_dir / f"consolidated.{rank:02d}.pth")


def save_shard(shard: Dict[str, torch.Tensor], path: Path) -> None:
    """torch.save of exactly these tensors' bytes: a tensor that is a slice of a larger one is copied first, since
    torch.save writes the whole storage a tensor views."""
    owned = {}
    for key, tensor in shard.items():
        if tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        owned[key] = tensor
    torch.save(owned, path)
