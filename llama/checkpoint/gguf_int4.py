"""A GGUF file's 4-bit weights as this project's int4 layers (`llama.quantize`), their codes kept.

Q4_0, Q4_1 and Q4_K all hold, for each group of 32 consecutive weights of a row, a 4-bit code q per weight and a
step s and offset o per group, w = s * q + o (Q4_0: o = -8 s; Q4_K computes s and o from 6-bit scales of a block of
256). That is an int4 group of 32 with a zero point: w = (q - 8) * scale + zero with scale = s, zero = o + 8 s. So
the codes are kept as they are, and only the scales and zeros take the model's dtype (exact in float32).

The step and offset of every group are found with ggml's own dequantization, not by decoding each format's header:
the blocks with every code set to 0 dequantize to each group's offset, with every code 1 to offset plus step. The
codes then follow from the dequantized weights.

Linear layers of other types in such a file (llama.cpp's Q4_K_M keeps some, the head among them, in Q6_K) are not
rounded to 4 bits a second time: they load dequantized, in floating point, and the load report names them.
"""

from typing import Dict

import numpy as np
import torch

from llama.quantize import pack_nibbles

GROUP_SIZE = 32  # the weights that share a step and an offset in every 4-bit GGUF type
# The 4-bit GGUF types kept as int4, and the byte at which a block's codes begin (before it: its scales).
CODES_START = {"Q4_0": 2, "Q4_1": 4, "Q4_K": 16}


def int4_from_blocks(blocks: np.ndarray, kind: str) -> Dict[str, torch.Tensor]:
    """`weight` (the codes, two per byte as `llama.quantize.pack_nibbles` packs them), `scales` and `zeros` (float32,
    one column per group of 32) of the rows of a 4-bit GGUF tensor (`blocks`: one array row of blocks per weight
    row; `kind` one of CODES_START)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    rows = blocks.shape[0]
    per_block = GGML_QUANT_SIZES[qtype][1]
    with_codes = blocks.reshape(rows, -1, per_block).copy()

    def groups(values: np.ndarray) -> np.ndarray:  # (rows, groups, 32)
        return values.reshape(rows, -1, GROUP_SIZE)

    with_codes[..., CODES_START[kind] :] = 0x00
    offset = groups(dequantize(with_codes.reshape(rows, -1), qtype))[..., 0]
    with_codes[..., CODES_START[kind] :] = 0x11  # code 1 in both nibbles of every byte
    step = groups(dequantize(with_codes.reshape(rows, -1), qtype))[..., 0] - offset
    weights = groups(dequantize(blocks, qtype))
    safe_step = np.where(step == 0, 1, step)[..., None]  # a group of zeros: any code will do
    codes = np.clip(np.rint((weights - offset[..., None]) / safe_step), 0, 15).astype(np.uint8)
    return {
        "weight": pack_nibbles(torch.from_numpy(codes.reshape(rows, -1))),
        "scales": torch.from_numpy(step),
        "zeros": torch.from_numpy(offset + 8 * step),
    }
