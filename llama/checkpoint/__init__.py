"""Checkpoint I/O, one concern a module: `params` (params.json and config.json as read), `shards` (how model
parallelism splits the tensors, each rank's share), `meta`, `hf` and `gguf_file` (the two folder formats and GGUF
files, read through one `CheckpointReader`; `gguf_int4` keeps a 4-bit file's codes, `gguf_write` writes GGUF,
`locate` finds ollama models), `quantized` (the quantized checkpoint format), `load` (the load sequence of
`Llama.build`), `report` (what a load tells the person waiting), `write` (Meta checkpoints written), `convert`
(between the formats, or quantized; `llama convert`'s work) and `random_weights` (a model to try things on). The
names below are the ones the rest of the package, the tools and the tests use.
"""

from llama.checkpoint.hf import (
    HuggingFaceCheckpoint,
    hf_config,
    hf_config_to_params,
    hf_to_meta_name,
    meta_to_hf_name,
    permute_for_interleaved,
    permute_for_rotate_half,
)
from llama.checkpoint.load import (
    AllocateOnMeta,
    check_kv_cache_fits,
    find_tokenizer,
    load_checkpoint,
    load_model,
    open_checkpoint,
)
from llama.checkpoint.meta import MetaCheckpoint, load_shard
from llama.checkpoint.params import (
    GENERATION_CONFIG,
    HF_CONFIG,
    HF_CONFIG_FIELDS,
    META_PARAMS,
    PARAMS_FIELDS,
    checked_int,
    generation_defaults,
    model_args_from,
    read_json,
    saved_quantization,
)
from llama.checkpoint.random_weights import random_weights
from llama.checkpoint.report import LoadReport, weights_bar
from llama.checkpoint.shards import (
    LINEAR_LAYERS,
    CheckpointReader,
    check_model_parallel_size,
    full_shapes,
    rank_weights,
    split_dim,
)
from llama.checkpoint.write import atomic_output_dir, check_new_output_dir, save_shard, write_meta_checkpoint

__all__ = [
    "GENERATION_CONFIG",
    "AllocateOnMeta",
    "CheckpointReader",
    "HF_CONFIG",
    "HF_CONFIG_FIELDS",
    "HuggingFaceCheckpoint",
    "LINEAR_LAYERS",
    "LoadReport",
    "META_PARAMS",
    "MetaCheckpoint",
    "PARAMS_FIELDS",
    "atomic_output_dir",
    "check_kv_cache_fits",
    "check_model_parallel_size",
    "check_new_output_dir",
    "checked_int",
    "find_tokenizer",
    "full_shapes",
    "generation_defaults",
    "hf_config",
    "hf_config_to_params",
    "hf_to_meta_name",
    "load_checkpoint",
    "load_model",
    "load_shard",
    "meta_to_hf_name",
    "model_args_from",
    "open_checkpoint",
    "permute_for_interleaved",
    "permute_for_rotate_half",
    "random_weights",
    "rank_weights",
    "read_json",
    "save_shard",
    "saved_quantization",
    "split_dim",
    "weights_bar",
    "write_meta_checkpoint",
]
