"""How model parallelism splits a checkpoint's tensors, and each rank's share of them.

Both formats are read through a `CheckpointReader`, which names tensors with Meta's keys and knows their full
(unsharded) shapes. `rank_weights` then cuts out what one rank of a model-parallel group needs, whatever the number
of shards on disk: that is how an 8-shard 70B runs on 2 GPUs, or a 1-shard 8B on 2.
"""

from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch

from llama.model import ModelArgs
from llama.os_memory import forget_file_pages

# fairscale's layout: column-parallel layers (and the vocab-parallel embedding) split their weight along
# dim 0, row-parallel layers along dim 1; everything else (the norms) is replicated on every rank.
TEXT_DIM_0 = {"tok_embeddings", "output", "wq", "wk", "wv", "w1", "w3"}
TEXT_DIM_1 = {"wo", "w2"}
LINEAR_LAYERS = TEXT_DIM_0 - {"tok_embeddings"} | TEXT_DIM_1  # the ones `llama.quantize` quantizes
# Llama 3.2 Vision's other layers (`llama.vision`): the image-token embedding, the encoder's patch projection and
# feed-forward layers (the biases of column-parallel layers split with their rows), and the projection to the text.
VISION_DIM_0 = {"learnable_embedding", "_linear", "c_fc", "vision_projection"}
VISION_DIM_1 = {"c_proj"}
SPLIT_ON_DIM_0 = TEXT_DIM_0 | VISION_DIM_0
SPLIT_ON_DIM_1 = TEXT_DIM_1 | VISION_DIM_1
IGNORED_KEYS = {"rope.freqs"}  # a precomputed RoPE table some Meta checkpoints carry; we compute our own


def split_dim(key: str) -> Optional[int]:
    """The dimension along which model parallelism splits the tensor `key` (None: replicated, or not a weight of a
    layer, such as a key without a dot, which the key check then names)."""
    module = key.split(".")[-2] if "." in key else None
    if module in SPLIT_ON_DIM_0:
        return 0
    if module in SPLIT_ON_DIM_1:
        return 1
    return None


def model_parallel_sizes_that_work(params: ModelArgs, upto: int = 64) -> List[int]:
    """Model-parallel sizes that divide every sharded dimension (heads, kv heads, FFN width, vocab)."""
    sizes = (params.n_heads, params.kv_heads, params.ffn_hidden_dim, params.vocab_size)
    return [m for m in range(1, upto + 1) if all(s % m == 0 for s in sizes)]


def check_model_parallel_size(
    params: ModelArgs,
    model_parallel_size: int,
    n_shards: Optional[int] = None,
    setting: str = "--nproc_per_node (or model_parallel_size)",
) -> None:
    """Raise a ValueError, telling which `setting` to change, when the model cannot be split that many ways."""
    if model_parallel_size not in model_parallel_sizes_that_work(params, upto=max(model_parallel_size, 64)):
        on_disk = f" (its checkpoint has {n_shards} shard{'s' if n_shards != 1 else ''})" if n_shards else ""
        raise ValueError(
            f"This model{on_disk} cannot be split over {model_parallel_size} model-parallel processes "
            f"(n_heads={params.n_heads}, n_kv_heads={params.kv_heads}, "
            f"vocab_size={params.vocab_size}). Sizes that work: {model_parallel_sizes_that_work(params)}. "
            f"Change {setting} to one of them."
        )


class CheckpointReader:
    """A checkpoint folder seen as full tensors with Meta's names, read lazily and in slices."""

    format: str  # "meta" or "hf"
    ckpt_dir: Path
    params: dict  # Meta params.json fields
    dtype: torch.dtype  # dtype the weights are stored in
    shapes: Dict[str, torch.Size]  # full, unsharded shapes of the model's tensors (IGNORED_KEYS left out)
    dtypes: Dict[str, torch.dtype]  # the dtype each of them is stored in
    float_layers: FrozenSet[str] = frozenset()  # of a quantized checkpoint, the linear layers kept in floating point

    def load_note(self) -> Optional[str]:
        """What the load report must add about the weights (a GGUF's layers of other types)."""
        return None

    def requantize(self) -> None:
        """Of a quantized checkpoint: give the layers it keeps in other forms (`float_layers`, a GGUF's embedding)
        quantized as its own scheme, for `quantize=` asked for by name."""

    def source(self, key: str) -> str:
        """Where `key` lives, for error messages."""
        raise NotImplementedError

    def mapped_files(self) -> List[Path]:
        """The files this reader maps into memory to read them."""
        return []

    def forget_read_pages(self) -> None:
        """Stop holding the file pages read so far in this process's memory: called as a quantized load goes, once
        what was read has been quantized (nothing has written to it). A tensor the model keeps as read (the
        embedding of a Meta checkpoint) reads its pages from the file again as it is used."""
        forget_file_pages(self.mapped_files())

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        """The tensor `key`, or its slice [start, start + length) along `dim` (in `dtype` if pieces are joined)."""
        raise NotImplementedError

    def read_shard(self, key: str, rank: int, size: int, dtype=None) -> torch.Tensor:
        """Rank `rank`'s part of `key` when the model is split over `size` model-parallel ranks (size 1: all)."""
        dim = split_dim(key)
        if dim is None or dim >= len(self.shapes[key]):  # also an int8 scale of a split row: the whole row's
            return self.read(key)
        length = self.shapes[key][dim] // size
        return self.read(key, dim, rank * length, length, dtype)


def rank_weights(
    reader: CheckpointReader,
    expected_shapes: Dict[str, torch.Size],
    mp_rank: int,
    mp_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """This rank's weights, keyed like `expected_shapes` (the model's own state dict), on `device` in `dtype`,
    read one at a time as the caller asks for them (the keys and shapes are all checked first).

    Raises:
        ValueError: when keys are missing or unexpected, or a shape or dtype does not match the model.
    """
    available = set(reader.shapes)
    tied = "output.weight" not in available and "output.weight" in expected_shapes
    missing = sorted(set(expected_shapes) - available - ({"output.weight"} if tied else set()))
    unexpected = sorted(available - set(expected_shapes))
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint {reader.ckpt_dir} does not match the model built from its config: "
            f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )
    for key, local_shape in expected_shapes.items():
        dim = split_dim(key)
        full_shape = list(local_shape)
        if dim is not None and dim < len(full_shape):
            full_shape[dim] *= mp_size
        if not (key == "output.weight" and tied) and list(reader.shapes[key]) != full_shape:
            raise ValueError(
                f"{key} in {reader.source(key)} has shape {tuple(reader.shapes[key])}, "
                f"but the model built from the checkpoint's config expects {tuple(full_shape)}"
            )
        if not (key == "output.weight" and tied):
            check_stored_dtype(key, reader, expected_shapes)
    for key in expected_shapes:
        if key == "output.weight" and tied:
            continue  # given with the embedding
        tensor = reader.read_shard(key, mp_rank, mp_size, dtype)
        tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None).contiguous()
        yield key, tensor
        if key == "tok_embeddings.weight" and tied:
            yield "output.weight", tensor  # the embedding, at once: no reference to it is kept here


def check_stored_dtype(key: str, reader: CheckpointReader, expected_shapes: Dict[str, torch.Size]) -> None:
    """Raise a ValueError naming `key` unless it is stored as the model needs it: floating point, or for the weight
    of a layer a quantized checkpoint stores (it has scales), int8 (int4: two values per uint8, beside zeros)."""
    stored, layer = reader.dtypes[key], key.removesuffix(".weight")
    if key.endswith(".weight") and f"{layer}.scales" in expected_shapes:
        wanted = torch.uint8 if f"{layer}.zeros" in expected_shapes else torch.int8
        ok, what = stored == wanted, f"{wanted} (quantized values)"
    else:
        ok, what = stored.is_floating_point, "floating point"
    if not ok:
        raise ValueError(f"{key} in {reader.source(key)} is stored as {stored}, but the model needs it {what}")


def full_shapes(args: ModelArgs) -> Dict[str, Tuple[int, ...]]:
    """The unsharded shape of every tensor of a Meta checkpoint for `args`, in Meta's key order."""
    head_dim, n_kv_heads, hidden = args.head_dim, args.kv_heads, args.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update(
            {
                f"layers.{i}.attention.wq.weight": (args.n_heads * head_dim, args.dim),
                f"layers.{i}.attention.wk.weight": (n_kv_heads * head_dim, args.dim),
                f"layers.{i}.attention.wv.weight": (n_kv_heads * head_dim, args.dim),
                f"layers.{i}.attention.wo.weight": (args.dim, args.n_heads * head_dim),
                f"layers.{i}.feed_forward.w1.weight": (hidden, args.dim),
                f"layers.{i}.feed_forward.w2.weight": (args.dim, hidden),
                f"layers.{i}.feed_forward.w3.weight": (hidden, args.dim),
                f"layers.{i}.attention_norm.weight": (args.dim,),
                f"layers.{i}.ffn_norm.weight": (args.dim,),
            }
        )
    shapes.update({"norm.weight": (args.dim,), "output.weight": (args.vocab_size, args.dim)})
    return shapes
