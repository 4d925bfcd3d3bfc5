"""GGUF files, the format of llama.cpp, ollama and LM Studio, read as a checkpoint: the model's shape from the
`llama.*` metadata, its tensors under Meta's names, float ones as stored and quantized ones (Q8_0, Q5_K, Q6_K, ...)
dequantized, one tensor at a time, by ggml's own `gguf` package. A 4-bit file (most of its linear layers Q4_0, Q4_1
or Q4_K) loads as int4, its codes kept (`llama.checkpoint.gguf_int4`): it reads as a quantized checkpoint would.

llama.cpp's converter stores the q and k rows in Meta's interleaved RoPE order (it undoes Hugging Face's permutation),
so a Llama GGUF's tensors are Meta's as they are. Llama 3.1 and later store their RoPE scaling as the tensor
`rope_freqs` (each frequency's divisor); it is checked against the scaling `llama.model` computes.

Everything a file claims is checked before a weight is read: the magic number, the metadata the model needs, every
tensor's type, shape and extent inside the file. A problem is a ValueError naming the file.
"""

import collections
import functools
import math
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

from llama.checkpoint.gguf_int4 import BLOCKS, GROUP_SIZE, int4_from_blocks
from llama.checkpoint.hf import hf_config_to_params
from llama.checkpoint.params import HF_CONFIG_FIELDS, check_fields
from llama.checkpoint.shards import LINEAR_LAYERS, CheckpointReader
from llama.model import apply_scaling
from llama.quantize import chunk_rows, int4_group_for, quantize_int4
from llama.tokenizer.gguf_vocab import gguf_reader, metadata, read_gguf_ranks

# GGUF metadata keys of a llama model -> the Hugging Face config.json fields they hold.
GGUF_CONFIG = {
    "llama.embedding_length": "hidden_size",
    "llama.block_count": "num_hidden_layers",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.feed_forward_length": "intermediate_size",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "llama.rope.freq_base": "rope_theta",
}
GGUF_REQUIRED = (
    "llama.embedding_length",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.feed_forward_length",
)

# GGUF tensor names -> Meta checkpoint keys: the model's own, and each block's parts.
GGUF_TOP_LEVEL = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}
GGUF_BLOCK = {
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "attn_norm": "attention_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3",
    "ffn_norm": "ffn_norm",
}
META_TO_GGUF_TOP_LEVEL = {meta: name for name, meta in GGUF_TOP_LEVEL.items()}
META_TO_GGUF_BLOCK = {meta: name for name, meta in GGUF_BLOCK.items()}
# The GGUF types read as they are, and those dequantized: the ones people download (Q4_K_M files mix Q4_K and Q6_K;
# Q5_K_M, Q5_K and Q6_K).
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DEQUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_VOCABULARY = "tokenizer.ggml."  # the metadata keys of the vocabulary
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's RoPE scaling, as llama.cpp stores it


def meta_key(name: str) -> Optional[str]:
    """The Meta checkpoint key of a GGUF tensor name (None for a name that is not a Llama weight)."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in GGUF_TOP_LEVEL:
        return f"{GGUF_TOP_LEVEL[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GGUF_BLOCK:
        return f"layers.{int(parts[1])}.{GGUF_BLOCK[parts[2]]}.{parts[3]}"
    return None


def gguf_name(key: str) -> str:
    """The GGUF tensor name of a Meta checkpoint key."""
    parts = key.split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{META_TO_GGUF_BLOCK['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{META_TO_GGUF_TOP_LEVEL[parts[0]]}.{parts[-1]}"


def shortest(value):
    """A float32 value of the file as the shortest decimal that gives it (1e-05, not 9.999999747378752e-06), as
    config.json would have it; other values as they are."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's frequencies before scaling, as `llama.model.precompute_freqs_cis` computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))


def open_gguf(path: Path):
    """`gguf_reader(path)`, each tensor's type known and its bytes inside the file, as its shape says."""
    reader = gguf_reader(path)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # installed: gguf_reader says so otherwise

    size = path.stat().st_size
    for tensor in reader.tensors:
        kind = GGMLQuantizationType(tensor.tensor_type)
        block, type_bytes = GGML_QUANT_SIZES[kind]
        expected = int(tensor.n_elements) // block * type_bytes
        if int(tensor.n_elements) % block or tensor.data.nbytes != expected or tensor.data_offset + expected > size:
            raise ValueError(
                f"{path}: tensor {tensor.name} of shape {tuple(int(n) for n in tensor.shape)} as {kind.name} needs "
                f"{expected} bytes, and the file holds {tensor.data.nbytes} of them: it is truncated or damaged"
            )
    return reader


class GGUFCheckpoint(CheckpointReader):
    """A GGUF file of a Llama model: its metadata as Meta params, its tensors with Meta's names."""

    format = "gguf"

    def __init__(self, path: Path, keep_int4: bool = True):
        """`keep_int4`: a 4-bit file loads as int4 (False: dequantized, as every other type)."""
        self.path = self.ckpt_dir = path
        self.reader = open_gguf(path)
        from gguf import GGMLQuantizationType

        architecture = metadata(self.reader, "general.architecture")
        if architecture != "llama":
            raise ValueError(
                f"{path} holds a {architecture!r} model; only Llama models (general.architecture 'llama') load here"
            )
        self.tensors, self.shapes, self.dtypes, self.types, unknown = {}, {}, {}, {}, []
        rope_freqs = None
        for tensor in self.reader.tensors:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            if tensor.name == ROPE_FREQS:
                rope_freqs = tensor
                continue
            key = meta_key(tensor.name)
            if key is None:
                unknown.append(tensor.name)
                continue
            if kind not in FLOAT_TYPES and kind not in DEQUANTIZED:
                raise ValueError(
                    f"{path}: tensor {tensor.name} is stored as {kind}, which this loader does not read; it reads "
                    f"{', '.join((*FLOAT_TYPES, *DEQUANTIZED))}"
                )
            self.tensors[key] = tensor
            self.types[key] = kind
            self.shapes[key] = torch.Size(reversed([int(n) for n in tensor.shape]))  # GGUF lists the fastest first
            if 0 in self.shapes[key]:
                raise ValueError(
                    f"{path}: tensor {tensor.name} has the shape {list(tensor.shape)}, with no values in it"
                )
            self.dtypes[key] = FLOAT_TYPES.get(kind, torch.float32)
        if unknown:
            raise ValueError(f"{path} holds tensors that are not part of a Llama model: {unknown[:10]}")
        self.params = self.read_params(rope_freqs)
        linear = [self.types[key] for key in self.types if key.startswith("layers.")]
        self.dtype = FLOAT_TYPES.get(max(set(linear), key=linear.count), torch.bfloat16) if linear else torch.float32
        self.int4_layers: Dict[str, str] = {}  # layer name -> GGUF type, for a 4-bit file's layers read as int4
        self.requantized: Dict[str, str] = {}  # those of them quantized from another type (`requantize`)
        self.int4_cache = (None, {})
        self.ranks = None  # `vocabulary`
        self.has_vocabulary = "tokenizer.ggml.tokens" in self.reader.fields
        self.float_layers = frozenset()
        if keep_int4 and linear and sum(kind in BLOCKS for kind in linear) * 2 >= len(linear):
            self.keep_int4()

    def keep_int4(self) -> None:
        """Present a 4-bit file as a quantized checkpoint (`llama.checkpoint.quantized`) of int4 in groups of 32:
        each 4-bit linear layer's codes, scales and zeros (`llama.checkpoint.gguf_int4`) in place of its weight, and
        so the embedding table's where it is 4-bit (an `Int4Embedding`). Its linear layers of other types (llama.cpp
        keeps some, the head often, in Q6_K or Q8_0) stay floating point, dequantized: quantizing them to 4 bits
        would round them a second time, and the head is the most sensitive; `quantize="int4"` asks for that
        (`load_note`). A tied head of 4 bits becomes an int4 layer of its own, made from the embedding, as a
        quantized checkpoint stores it."""
        if "output.weight" not in self.shapes:
            if self.types["tok_embeddings.weight"] in BLOCKS:
                self.head_of_its_own()
            else:
                self.float_layers |= {"output"}  # tied to the embedding, as it loads
        self.linear_count = 0
        for key in list(self.shapes):
            layer = key.removesuffix(".weight")
            if key.split(".")[-2] in LINEAR_LAYERS:
                self.linear_count += 1
                if not self.store_as_int4(layer):
                    self.float_layers |= {layer}
        self.store_as_int4("tok_embeddings")
        self.params["quantization"] = {"scheme": "int4", "group_size": GROUP_SIZE}

    def head_of_its_own(self) -> None:
        """Present a tied head as a layer of its own, read from the embedding table (as a quantized checkpoint
        stores a tied head)."""
        for table in (self.tensors, self.types, self.shapes, self.dtypes):
            table["output.weight"] = table["tok_embeddings.weight"]
        self.params.pop("tie_word_embeddings", None)

    def store_as_int4(self, layer: str, requantized: bool = False) -> bool:
        """Present the weight of `layer` as its int4 parts, where it is 4-bit (or `requantized`) in groups that
        int4 holds."""
        key = f"{layer}.weight"
        rows, cols = self.shapes[key]
        if (self.types[key] not in BLOCKS and not requantized) or int4_group_for(rows, cols, GROUP_SIZE) != GROUP_SIZE:
            return False
        self.int4_layers[layer] = self.types.pop(key)
        self.shapes[key], self.dtypes[key] = torch.Size([rows, cols // 2]), torch.uint8
        for part in ("scales", "zeros"):
            self.shapes[f"{layer}.{part}"] = torch.Size([rows, cols // GROUP_SIZE])
            self.dtypes[f"{layer}.{part}"] = torch.float32
        return True

    def requantize(self) -> None:
        """Give the layers a 4-bit file holds in other types (`float_layers`, and the embedding table where it is
        not 4-bit) as int4 too, quantized by `llama.quantize` from the file's values a block of rows at a time: so a
        load never holds one of them whole in floating point. The load report names them (`load_note`)."""
        kinds = {layer: self.types.get(f"{layer}.weight", "tied") for layer in self.float_layers}
        if kinds.get("output") == "tied":
            self.head_of_its_own()
        if "tok_embeddings" not in self.int4_layers:
            kinds["tok_embeddings"] = self.types["tok_embeddings.weight"]
        for layer, kind in sorted(kinds.items()):
            if self.store_as_int4(layer, requantized=True):
                self.requantized[layer] = kind
        self.float_layers -= set(self.requantized)

    def load_note(self) -> Optional[str]:
        """What the load report adds: the embedding table's form, and the linear layers not kept as int4 (loaded
        dequantized, or requantized), by their type in the file."""
        requantized = dict(self.requantized)
        notes = []
        if "tok_embeddings" in requantized:
            notes.append(f"embedding requantized to int4 (from {requantized.pop('tok_embeddings')})")
        elif "tok_embeddings" in self.int4_layers:
            notes.append(f"embedding int4 ({self.int4_layers['tok_embeddings']}, codes kept)")
        dequantized = {layer: self.types.get(f"{layer}.weight", "tied") for layer in self.float_layers}
        for done, layers in (("requantized to int4", requantized), ("dequantized, not int4", dequantized)):
            if layers:
                counts = sorted(collections.Counter(layers.values()).items())
                named = ", ".join(f"{count} {kind}" for kind, count in counts)
                notes.append(f"{len(layers)} of {self.linear_count} layers {done} ({named})")
        return "; ".join(notes) or None

    def read_params(self, rope_freqs) -> dict:
        """Meta params from the `llama.*` metadata, checked as config.json's fields are; RoPE scaling from the
        `rope_freqs` tensor."""
        values = {key: shortest(metadata(self.reader, key)) for key in GGUF_CONFIG if key in self.reader.fields}
        check_fields(values, {key: HF_CONFIG_FIELDS[hf] for key, hf in GGUF_CONFIG.items()}, GGUF_REQUIRED, self.path)
        config = {GGUF_CONFIG[key]: value for key, value in values.items()}
        config["architectures"] = ["LlamaForCausalLM"]
        if "tok_embeddings.weight" not in self.shapes:
            raise ValueError(f"{self.path} has no token_embd.weight, the token embedding every Llama model has")
        config["vocab_size"] = self.shapes["tok_embeddings.weight"][0]
        head_dim = metadata(self.reader, "llama.attention.key_length")
        if head_dim is not None:
            config["head_dim"] = head_dim
        scaling = metadata(self.reader, "llama.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ValueError(f"{self.path}: RoPE scaling {scaling!r} is not Llama 3's; only Llama models load here")
        if rope_freqs is not None:
            config["rope_scaling"] = {"rope_type": "llama3", "factor": self.rope_factor(rope_freqs, config)}
        params = hf_config_to_params(config, self.path)
        if "output.weight" not in self.shapes:
            params["tie_word_embeddings"] = True
        return params

    def rope_factor(self, rope_freqs, config: dict) -> float:
        """The Llama 3.1 scaling factor whose frequency divisors `rope_freqs` holds (its largest), checked against
        those `llama.model.apply_scaling` gives with it."""
        divisors = torch.from_numpy(np.array(rope_freqs.data, dtype=np.float32).reshape(-1))
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        theta = config.get("rope_theta", 10000.0)
        if divisors.numel() != head_dim // 2 or not torch.isfinite(divisors).all() or divisors.min() <= 0:
            raise ValueError(f"{self.path}: {ROPE_FREQS} must hold {head_dim // 2} positive numbers, one a frequency")
        factor = float(divisors.max())
        freqs = rope_frequencies(head_dim, theta)
        if not torch.allclose(freqs / apply_scaling(freqs, factor), divisors, rtol=1e-3) or not math.isfinite(factor):
            raise ValueError(
                f"{self.path}: {ROPE_FREQS} is not Llama 3.1's RoPE scaling (factor {factor:g}, low and high "
                "frequency factors 1 and 4, original context 8192); no other scaling is supported"
            )
        return factor

    def source(self, key: str) -> str:
        return f"{self.path.name} ({self.tensors[key].name})"

    def vocabulary(self) -> Dict[bytes, int]:
        """The BPE ranks of the file's Llama 3 vocabulary (`llama.tokenizer.gguf_vocab.gguf_bpe_ranks`), read once:
        the metadata they come from is let go then (Llama 3's tokens and merges, parsed, take 150 MB)."""
        if self.ranks is None:
            self.ranks = read_gguf_ranks(self.path, self.reader)
            for name in [name for name in self.reader.fields if name.startswith(GGUF_VOCABULARY)]:
                del self.reader.fields[name]
        return self.ranks

    def read(self, key: str, dim: Optional[int] = None, start: int = 0, length: Optional[int] = None, dtype=None):
        """The tensor `key` (or its slice along `dim`), float ones as stored, quantized ones dequantized into
        `dtype` (float32 if None) a block of rows at a time; of a 4-bit file's linear layers, the int4 parts."""
        layer, _, part = key.rpartition(".")
        if layer in self.int4_layers:
            values = self.int4_part(layer, part, dim, start, length, dtype)
            if dtype is not None and values.is_floating_point():
                values = values.to(dtype)
            return values.narrow(dim, start, length) if dim == 1 else values
        kind = self.types[key]
        rows = self.rows(key, start, length) if dim == 0 else self.rows(key)
        dim = None if dim == 0 else dim
        if kind in FLOAT_TYPES:
            values = torch.from_numpy(rows).view(FLOAT_TYPES[kind])
            values = values.view(self.shapes[key]) if len(self.shapes[key]) == 1 else values
        else:
            values = dequantized(rows, kind, dtype or torch.float32)
        return values if dim is None else values.narrow(dim, start, length)

    def rows(self, key: str, start: int = 0, length: Optional[int] = None) -> np.ndarray:
        """The stored bytes of rows [start, start + length) of `key` (all rows by default), one array row per weight
        row (a 1-D tensor: one row). Read from the file, not through its memory map, whose pages would count in
        this process's resident memory until the process ends."""
        tensor = self.tensors[key]
        n_rows = self.shapes[key][0] if len(self.shapes[key]) > 1 else 1
        row_bytes = int(tensor.n_bytes) // n_rows
        length = n_rows - start if length is None else length
        rows = np.empty((length, row_bytes), dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(int(tensor.data_offset) + start * row_bytes)
            read = f.readinto(memoryview(rows).cast("B"))
        if read != rows.nbytes:
            raise ValueError(f"{self.path}: tensor {tensor.name} ends past the end of the file; it is truncated")
        return rows

    def int4_part(
        self, layer: str, part: str, dim: Optional[int], start: int, length: Optional[int], dtype
    ) -> torch.Tensor:
        """One of a layer's int4 parts (of rows [start, start + length) where `dim` is 0): a 4-bit layer's own, a
        requantized one's quantized with scales in `dtype`. The three are made together, a block of rows at a time,
        for the three reads a load makes in a row; each is let go as it is read."""
        rows_wanted = (start, length) if dim == 0 else (0, None)
        if self.int4_cache[0] != (layer, rows_wanted) or part not in self.int4_cache[1]:
            self.int4_cache = ((layer, rows_wanted), self.make_int4_parts(layer, *rows_wanted, dtype))
        return self.int4_cache[1].pop(part)

    def make_int4_parts(self, layer: str, start: int, length: Optional[int], dtype) -> Dict[str, torch.Tensor]:
        key, kind = f"{layer}.weight", self.int4_layers[layer]
        length = self.shapes[key][0] - start if length is None else length
        if layer in self.requantized:
            parts_of = functools.partial(requantized_int4, kind=kind, dtype=dtype or torch.float32)
        else:
            parts_of = functools.partial(int4_from_blocks, kind=kind)
        parts, step = {}, chunk_rows(self.shapes[key][1] * 2)  # a block: the float32 copies it passes through
        for i in range(0, length, step):  # filled in place: no second copy of the whole layer
            block = parts_of(self.rows(key, start + i, min(step, length - i)))
            for name, values in block.items():
                if name not in parts:
                    parts[name] = torch.empty(length, values.shape[1], dtype=values.dtype)
                parts[name][i : i + len(values)] = values
        return parts


def requantized_int4(rows: np.ndarray, kind: str, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The int4 parts, as `int4_from_blocks` gives them, of `rows` of another type quantized by `llama.quantize`
    (scales and zeros in `dtype`, the kernel's)."""
    if kind in FLOAT_TYPES:
        values = torch.from_numpy(rows).view(FLOAT_TYPES[kind]).float()
    else:
        values = dequantized(rows, kind, torch.float32)
    weight, scales, zeros = quantize_int4(values, GROUP_SIZE, dtype)
    return {"weight": weight, "scales": scales, "zeros": zeros}


def dequantized(rows: np.ndarray, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Quantized `rows` (one array row of blocks per weight row; `kind` the GGUF type's name) as a (rows, columns)
    tensor in `dtype`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType[kind]
    values_per_block, block_bytes = GGML_QUANT_SIZES[kind]
    step = chunk_rows(rows.shape[1] // block_bytes * values_per_block)  # a block: the float32 copies it passes through
    out = None
    for i in range(0, rows.shape[0], step):  # filled in place: no second copy of the whole tensor
        block = torch.from_numpy(dequantize(rows[i : i + step], kind))
        out = torch.empty(rows.shape[0], block.shape[1], dtype=dtype) if out is None else out
        out[i : i + len(block)] = block
    return out
