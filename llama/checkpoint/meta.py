"""Meta's checkpoint folders, read: params.json plus consolidated.NN.pth, one shard per model-parallel rank."""

from pathlib import Path
from typing import Dict, List, Optional

import torch

from llama.arguments import short_repr
from llama.checkpoint.params import META_PARAMS, PARAMS_FIELDS, PARAMS_REQUIRED, check_fields, read_json
from llama.checkpoint.shards import IGNORED_KEYS, CheckpointReader, split_dim


class MetaCheckpoint(CheckpointReader):
    """Meta's layout: params.json plus consolidated.NN.pth, one shard per model-parallel rank."""

    format = "meta"

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = ckpt_dir
        self.params = read_json(ckpt_dir / META_PARAMS)
        check_fields(self.params, PARAMS_FIELDS, PARAMS_REQUIRED, ckpt_dir / META_PARAMS)
        self.files = sorted(ckpt_dir.glob("*.pth"))
        if not self.files:
            raise FileNotFoundError(f"No checkpoint files (*.pth) found in {ckpt_dir}; expected consolidated.00.pth")
        self.shards = [load_shard(f) for f in self.files]
        self.shapes, self.dtypes = {}, {}
        first = self.shards[0]
        for path, shard in zip(self.files[1:], self.shards[1:]):
            if shard.keys() != first.keys():
                diff = sorted(shard.keys() ^ first.keys())
                raise ValueError(f"{path.name} and {self.files[0].name} hold different keys: {diff[:10]}")
        for key, tensor in first.items():
            if key in IGNORED_KEYS:
                continue
            for path, shard in zip(self.files[1:], self.shards[1:]):
                if shard[key].dtype != tensor.dtype:
                    raise ValueError(
                        f"{key} is {shard[key].dtype} in {path.name} but {tensor.dtype} in {self.files[0].name}; "
                        "the shards do not belong together"
                    )
            self.dtypes[key] = tensor.dtype
            dim = split_dim(key)
            shape = list(tensor.shape)
            if dim is not None and dim < len(shape):
                for path, shard in zip(self.files[1:], self.shards[1:]):
                    if shard[key].shape[dim] != tensor.shape[dim]:
                        raise ValueError(
                            f"{key} has shape {tuple(shard[key].shape)} in {path.name} but "
                            f"{tuple(tensor.shape)} in {self.files[0].name}; the shards do not belong together"
                        )
                shape[dim] *= len(self.shards)
            self.shapes[key] = torch.Size(shape)
        self.dtype = next(iter(first.values())).dtype if first else torch.bfloat16

    def source(self, key: str) -> str:
        return ", ".join(f.name for f in self.files)

    def mapped_files(self) -> List[Path]:
        return self.files  # torch.load(mmap=True)

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        if dim is None:
            return self.shards[0][key]
        # Gather [start, start + length) of the concatenation of all shards along `dim`.
        per_shard = self.shards[0][key].shape[dim]
        pieces, end = [], start + length
        for index, shard in enumerate(self.shards):
            lo, hi = max(start, index * per_shard), min(end, (index + 1) * per_shard)
            if lo < hi:
                pieces.append(shard[key].narrow(dim, lo - index * per_shard, hi - lo))
        if len(pieces) == 1:
            return pieces[0]
        # Join straight into the dtype asked for: no extra copy of the whole slice in the stored dtype.
        shape = list(pieces[0].shape)
        shape[dim] = length
        stored = pieces[0].dtype
        dtype = dtype if dtype is not None and stored.is_floating_point else stored  # quantized values stay ints
        return torch.cat(pieces, dim=dim, out=torch.empty(shape, dtype=dtype))


def load_shard(path: Path) -> Dict[str, torch.Tensor]:
    """A consolidated.NN.pth file's tensors, mmap-ed (nothing is read until a slice is used), or a ValueError
    naming the file when it is not a complete PyTorch checkpoint."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # whatever a damaged file makes torch raise: pickle, zip and OS errors among others
        reason = str(e).split(". ")[0].splitlines()[0] if str(e) else type(e).__name__  # torch's first sentence
        raise ValueError(
            f"{path} is not a readable PyTorch checkpoint ({reason}): it is truncated, damaged or of another format. "
            "Download it again."
        ) from e
    if not isinstance(shard, dict) or not all(isinstance(t, torch.Tensor) for t in shard.values()):
        raise ValueError(f"{path} holds {type(shard).__name__}, not a dict of tensors; it is not a Llama checkpoint")
    for key, tensor in shard.items():
        if not isinstance(key, str):
            raise ValueError(f"{path} holds a tensor under {short_repr(key)}, not a name; it is not a Llama checkpoint")
        if tensor.layout != torch.strided:
            raise ValueError(f"{key} in {path} is a {tensor.layout} tensor; a Llama checkpoint holds dense tensors")
    return shard
