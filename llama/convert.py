"""Convert checkpoints between Meta's layout and Hugging Face's, in either direction.

    python -m llama.convert to-hf   META_DIR OUT_DIR [--max_shard_gb 5]
    python -m llama.convert to-meta HF_DIR   OUT_DIR [--model_parallel_size N]

Tensors are streamed: at most one output file's worth of weights is in memory at a time. The output is
written to a temporary folder and renamed when complete, so an interrupted run never looks finished.
"""

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from safetensors.torch import save_file

from llama.checkpoint import (
    atomic_output_dir,
    check_model_parallel_size,
    find_tokenizer,
    hf_config,
    meta_to_hf_name,
    model_args_from,
    open_checkpoint,
    permute_for_rotate_half,
    save_shard,
)
from llama.cli import user_errors


def meta_to_hf(src: Path, out_dir: Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a Hugging Face folder (config.json, model-*.safetensors, index) for a Meta checkpoint."""
    reader = open_checkpoint(src)
    if reader.format != "meta":
        raise ValueError(f"{src} is not a Meta checkpoint (no params.json); did you mean `to-meta`?")
    args, _ = model_args_from(reader.params)
    tied = "output.weight" not in reader.shapes
    params = dict(reader.params, **({"tie_word_embeddings": True} if tied else {}))
    with atomic_output_dir(out_dir) as tmp_dir:
        (tmp_dir / "config.json").write_text(json.dumps(hf_config(params, reader.dtype), indent=2) + "\n")
        groups = list(group_by_size(reader.shapes, reader.dtype, max_shard_bytes))
        weight_map, total_bytes = {}, 0
        for index, keys in enumerate(groups):
            file_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for key in keys:
                tensor = read_full(reader, key)
                if key.endswith(("attention.wq.weight", "attention.wk.weight")):
                    tensor = permute_for_rotate_half(tensor, tensor.shape[0] // args.head_dim)
                tensors[meta_to_hf_name(key)] = tensor.contiguous()
                weight_map[meta_to_hf_name(key)] = file_name
                total_bytes += tensor.numel() * tensor.element_size()
            save_file(tensors, tmp_dir / file_name, metadata={"format": "pt"})
            # safetensors creates its files readable by their owner only; give them config.json's permissions.
            shutil.copymode(tmp_dir / "config.json", tmp_dir / file_name)
            print(f"[{index + 1}/{len(groups)}] wrote {file_name} ({len(keys)} tensors)", flush=True)
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
        copy_tokenizer(src, tmp_dir)


def hf_to_meta(src: Path, out_dir: Path, model_parallel_size: int = 1) -> None:
    """Write a Meta folder (params.json, consolidated.NN.pth) for a Hugging Face checkpoint."""
    reader = open_checkpoint(src)
    if reader.format != "hf":
        raise ValueError(f"{src} is not a Hugging Face checkpoint (no config.json); did you mean `to-hf`?")
    args, _ = model_args_from(reader.params)
    check_model_parallel_size(args, model_parallel_size, setting="--model_parallel_size")
    params = {k: v for k, v in reader.params.items() if k != "tie_word_embeddings"}
    with atomic_output_dir(out_dir) as tmp_dir:
        (tmp_dir / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        for rank in range(model_parallel_size):
            shard = {key: reader.read_shard(key, rank, model_parallel_size) for key in reader.shapes}
            save_shard(shard, tmp_dir / f"consolidated.{rank:02d}.pth")
            print(f"[{rank + 1}/{model_parallel_size}] wrote consolidated.{rank:02d}.pth", flush=True)
            del shard
        copy_tokenizer(src, tmp_dir)


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


def copy_tokenizer(src: Path, out_dir: Path) -> Optional[Path]:
    """Copy the checkpoint's tokenizer.model along, if it has one."""
    try:
        return Path(shutil.copy(find_tokenizer(src), out_dir / "tokenizer.model"))
    except FileNotFoundError:
        return None


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="Meta checkpoint -> Hugging Face folder")
    to_hf.add_argument("src", type=Path)
    to_hf.add_argument("out_dir", type=Path)
    to_hf.add_argument("--max_shard_gb", type=float, default=5.0, help="largest .safetensors file, in GiB")
    to_meta = sub.add_parser("to-meta", help="Hugging Face folder -> Meta checkpoint")
    to_meta.add_argument("src", type=Path)
    to_meta.add_argument("out_dir", type=Path)
    to_meta.add_argument("--model_parallel_size", type=int, default=1, help="consolidated.NN.pth shards to write")
    args = parser.parse_args(argv)
    start = time.time()
    with user_errors(["max_shard_gb", "model_parallel_size"]):
        if args.direction == "to-hf":
            meta_to_hf(args.src, args.out_dir, int(args.max_shard_gb * 2**30))
        else:
            hf_to_meta(args.src, args.out_dir, args.model_parallel_size)
    print(f"Converted {args.src} to {args.out_dir} in {time.time() - start:.1f} seconds")


if __name__ == "__main__":
    main()
