"""The quantized checkpoint format (`python -m llama.convert quantize` writes it, `load_model` reads it): what a
quantized checkpoint stores for each linear layer, in the portable layout of `llama.quantize`'s rounding."""

from typing import Dict, Optional

import torch
from fairscale.nn.model_parallel.layers import VocabParallelEmbedding
from torch import nn

from llama.quantize import int4_group_for, quantize_int4, quantize_int8
from llama.runtime.quantized import Int4Embedding, Int4Linear, Int8Linear

# A quantized checkpoint (`python -m llama.convert quantize`) stores each linear layer of the model as
# "<name>.weight" (int8, or for int4 two 4-bit values per uint8: even inputs in the low nibble), "<name>.scales"
# and, for int4, "<name>.zeros", in the portable layout of `quantize_int8` and `quantize_int4`; params.json names
# the scheme under "quantization". The kernel's layout is made at load, for the device at hand.
SAVED_DTYPE = torch.bfloat16  # quantized checkpoints are made from bfloat16 weights and hold bfloat16 floats


def saved_shapes(
    rows: int, cols: int, row_parallel: bool, scheme: str, group_size: Optional[int], mp_size: int
) -> Dict[str, torch.Size]:
    """The shapes of one process's slice of what a quantized checkpoint stores for a linear layer whose whole
    weight is `rows` x `cols`, by tensor name.

    Raises:
        ValueError: when splitting the layer over `mp_size` processes would cut its int4 groups.
    """
    size = int4_group_for(rows, cols, group_size, row_parallel, mp_size) if scheme == "int4" else None
    rows, cols = (rows, cols // mp_size) if row_parallel else (rows // mp_size, cols)
    if size is None:  # int8; a split row keeps the whole row's scale
        return {"weight": torch.Size([rows, cols]), "scales": torch.Size([rows])}
    groups = torch.Size([rows, cols // size])
    return {"weight": torch.Size([rows, cols // 2]), "scales": groups, "zeros": groups}


def quantize_for_saving(weight: torch.Tensor, scheme: str, group_size: Optional[int]) -> Dict[str, torch.Tensor]:
    """What a quantized checkpoint stores for a linear layer, given its whole floating-point `weight`."""
    weight = weight.to(SAVED_DTYPE)
    size = int4_group_for(*weight.shape, group_size) if scheme == "int4" else None
    if size is None:
        q, scales = quantize_int8(weight, SAVED_DTYPE)
        return {"weight": q, "scales": scales}
    q, scales, zeros = quantize_int4(weight, size, SAVED_DTYPE)
    return {"weight": q, "scales": scales, "zeros": zeros}


def layer_from_saved(
    layer: nn.Module, weight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None
) -> nn.Module:
    """The quantized layer for this process's slice of what a quantized checkpoint stores for `layer` (a linear
    layer, or the embedding of a 4-bit GGUF file)."""
    if isinstance(layer, VocabParallelEmbedding):
        return Int4Embedding(layer, weight, scales, zeros)
    if zeros is None:
        return Int8Linear(layer, weight, scales)
    return Int4Linear(layer, weight, scales, zeros)
