"""A checkpoint written as a GGUF file, as llama.cpp's own converter writes a Llama model: its `llama.*` metadata,
Llama 3's vocabulary with its merges (`llama.tokenizer.gguf_vocab`), Llama 3.1's RoPE scaling as `rope_freqs`, and
its matrices in F32, F16, BF16, Q8_0, Q4_0 or Q4_1 (norms in F32, as llama.cpp keeps them), in Meta's q and k row
order, which is llama.cpp's. Tensors are written one at a time: their headers first, then each tensor as it is
read.
"""

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from llama.checkpoint.gguf_file import FLOAT_TYPES, ROPE_FREQS, gguf_name, rope_frequencies
from llama.checkpoint.shards import CheckpointReader
from llama.model import apply_scaling
from llama.tokenizer import Tokenizer
from llama.tokenizer.bpe import load_bpe_ranks
from llama.tokenizer.gguf_vocab import (
    CONTROL,
    GGUF_PRE_TOKENIZER,
    GGUF_TOKENIZER_MODEL,
    NORMAL,
    bpe_merges,
    token_text,
)

QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # made by the gguf package's port of llama.cpp's reference quantizer
GGUF_TYPES = (*FLOAT_TYPES, *QUANTIZED_TYPES)


def write_gguf(reader: CheckpointReader, tokenizer_path: Optional[str], out: Path, file_type: str, bar) -> None:
    """Write `reader`'s model (with the vocabulary of the tokenizer at `tokenizer_path`, if given) to the GGUF file
    `out`, its matrices in `file_type` (one of `GGUF_TYPES`). `bar` wraps the tensor names as they are written (a
    progress bar)."""
    import gguf

    from llama.checkpoint.params import model_args_from

    args, _ = model_args_from(reader.params)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(args.context_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type(gguf.LlamaFileType["ALL_F32" if file_type == "F32" else f"MOSTLY_{file_type}"])
    if tokenizer_path is not None:
        add_vocabulary(writer, tokenizer_path, "3.1" if args.use_scaled_rope else "3")
    else:
        writer.add_tokenizer_model("none")
    tensors = {}  # GGUF name -> (Meta key or None for rope_freqs, GGUF type)
    if args.use_scaled_rope:
        tensors[ROPE_FREQS] = (None, "F32")
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[file_type]][0]
    for key, shape in reader.shapes.items():
        fits = len(shape) > 1 and shape[-1] % block == 0  # a quantized type's blocks tile each row
        tensors[gguf_name(key)] = (key, file_type if fits else "F32")
    for name, (key, kind) in tensors.items():
        shape = (args.head_dim // 2,) if key is None else tuple(reader.shapes[key])
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        stored = (*shape[:-1], shape[-1] // block * type_bytes)  # in bytes, for a quantized type
        dtype = {"F32": np.float32, "F16": np.float16}.get(kind, np.uint8)  # BF16 too goes as bytes
        shape = stored if dtype is np.uint8 else shape
        nbytes = int(np.prod(stored))
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in bar(list(tensors)):
        key, kind = tensors[name]
        values = rope_divisors(args) if key is None else reader.read_shard(key, 0, 1)
        writer.write_tensor_data(gguf_values(values, kind))
    writer.close()


def gguf_values(values: torch.Tensor, kind: str) -> np.ndarray:
    """`values` as the GGUF type `kind` stores them, in a numpy array (BF16 and quantized types: its bytes)."""
    if kind in QUANTIZED_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        return quantize(values.float().numpy(), GGMLQuantizationType[kind])
    values = values.to(FLOAT_TYPES[kind]).contiguous()
    return (values.view(torch.uint8) if kind == "BF16" else values).numpy()


def rope_divisors(args) -> torch.Tensor:
    """Llama 3.1's RoPE scaling as llama.cpp stores it: what each frequency is divided by."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta)
    return freqs / apply_scaling(freqs, args.rope_scaling_factor or 8)


def add_vocabulary(writer, tokenizer_path: str, version: str) -> None:
    """Llama 3's vocabulary as llama.cpp reads it: each BPE token's bytes in GPT-2's characters, then the special
    tokens by name (of Llama `version`), the merges that rebuild each token, and the begin, end and end-of-turn
    tokens."""
    tokenizer, ranks = Tokenizer(tokenizer_path, version=version), load_bpe_ranks(tokenizer_path)
    by_rank = sorted(ranks, key=ranks.get)
    names = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    writer.add_tokenizer_model(GGUF_TOKENIZER_MODEL)
    writer.add_tokenizer_pre(GGUF_PRE_TOKENIZER)
    writer.add_token_list([token_text(token) for token in by_rank] + names)
    writer.add_token_types([NORMAL] * len(by_rank) + [CONTROL] * len(names))
    writer.add_token_merges([f"{token_text(a)} {token_text(b)}" for a, b in bpe_merges(ranks)])
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_eot_token_id(tokenizer.eot_id)
