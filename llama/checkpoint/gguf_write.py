"""A checkpoint written as a GGUF file, as llama.cpp's own converter writes a Llama model: its `llama.*` metadata,
Llama 3's vocabulary with its merges (`llama.tokenizer.gguf_vocab`), Llama 3.1's RoPE scaling as `rope_freqs`, and
its tensors in F32, F16 or BF16 (norms in F32, as llama.cpp keeps them), in Meta's q and k row order, which is
llama.cpp's. Tensors are written one at a time: their headers first, then each tensor as it is read.
"""

from pathlib import Path
from typing import Optional

import numpy as np
import torch

from llama.checkpoint.gguf_file import ROPE_FREQS, gguf_name, rope_frequencies
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

GGUF_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def write_gguf(reader: CheckpointReader, tokenizer_path: Optional[str], out: Path, file_type: str, bar) -> None:
    """Write `reader`'s model (with the vocabulary of the tokenizer at `tokenizer_path`, if given) to the GGUF file
    `out`, its matrices in `file_type` ("F32", "F16" or "BF16"). `bar` wraps the tensor names as they are written
    (a progress bar)."""
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
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if file_type == "F32" else f"MOSTLY_{file_type}"))
    if tokenizer_path is not None:
        add_vocabulary(writer, tokenizer_path, "3.1" if args.use_scaled_rope else "3")
    else:
        writer.add_tokenizer_model("none")
    tensors = {}  # GGUF name -> (Meta key or None for rope_freqs, GGUF type)
    if args.use_scaled_rope:
        tensors[ROPE_FREQS] = (None, "F32")
    for key, shape in reader.shapes.items():
        tensors[gguf_name(key)] = (key, file_type if len(shape) > 1 else "F32")
    for name, (key, kind) in tensors.items():
        shape = (args.head_dim // 2,) if key is None else tuple(reader.shapes[key])
        nbytes = int(np.prod(shape)) * GGUF_TYPES[kind].itemsize
        dtype = np.float32 if kind == "F32" else np.float16  # BF16 goes as raw bytes, with its type given
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in bar(list(tensors)):
        key, kind = tensors[name]
        values = rope_divisors(args) if key is None else reader.read_shard(key, 0, 1)
        values = values.to(GGUF_TYPES[kind]).contiguous()
        if kind == "BF16":
            values = values.view(torch.int16)
        writer.write_tensor_data(values.numpy())
    writer.close()


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
