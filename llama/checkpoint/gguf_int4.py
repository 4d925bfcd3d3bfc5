"""A GGUF file's 4-bit weights as this project's int4 layers (`llama.quantize`), their codes kept.

Q4_0, Q4_1 and Q4_K all hold, for each group of 32 consecutive weights of a row, a 4-bit code q per weight and a
step s and offset o per group, w = s * q + o:
- Q4_0, blocks of 32: a float16 d, then the codes; s = d, o = -8 d.
- Q4_1, blocks of 32: float16 d and m, then the codes; s = d, o = m.
- Q4_K, blocks of 256: float16 d and dmin, twelve bytes of 6-bit scales and mins (one pair per group of 32, unpacked
  by the gguf package's own `Q4_K.get_scale_min`), then the codes; s = d * scale, o = -dmin * min.
In each, a run of code bytes holds one group's codes in its low nibbles and the next group's in its high ones (runs
of 16 bytes in Q4_0 and Q4_1, of 32 in Q4_K).

That is an int4 group of 32 with a zero point: w = (q - 8) * scale + zero with scale = s, zero = o + 8 s. So the codes
are kept as they are, and only the scales and zeros take the model's dtype (exact in float32). Linear layers of other
types in such a file (llama.cpp's Q4_K_M keeps some, the head among them, in Q6_K) are not rounded to 4 bits a second
time: they load dequantized, in floating point, and the load report names them.
"""

from typing import Dict, Tuple

import numpy as np
import torch

from llama.quantize import pack_nibbles

GROUP_SIZE = 32  # the weights that share a step and an offset in every 4-bit GGUF type
# The 4-bit GGUF types kept as int4: a block's bytes, where its codes begin, and the bytes of a run of codes.
BLOCKS = {"Q4_0": (18, 2, 16), "Q4_1": (20, 4, 16), "Q4_K": (144, 16, 32)}


def steps_and_offsets(blocks: np.ndarray, kind: str) -> Tuple[np.ndarray, np.ndarray]:
    """Each group's step s and offset o (float32, one row per block, one column per group of 32)."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "Q4_0":
        return d, -8 * d
    second = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    if kind == "Q4_1":
        return d, second
    from gguf.quants import Q4_K

    scales, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return d * scales.astype(np.float32), -(second * mins.astype(np.float32))


def codes(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Each weight's 4-bit code (uint8, one row per block), in the weights' order."""
    _, start, run = BLOCKS[kind]
    packed = blocks[:, start:].reshape(blocks.shape[0], -1, 1, run)
    return ((packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(blocks.shape[0], -1)


def int4_from_blocks(rows: np.ndarray, kind: str) -> Dict[str, torch.Tensor]:
    """`weight` (the codes, two per byte as `llama.quantize.pack_nibbles` packs them), `scales` and `zeros` (float32,
    one column per group of 32) of the rows of a 4-bit GGUF tensor (`rows`: one array row of blocks per weight row;
    `kind` one of BLOCKS)."""
    n_rows = rows.shape[0]
    blocks = rows.reshape(-1, BLOCKS[kind][0])
    step, offset = steps_and_offsets(blocks, kind)
    return {
        "weight": pack_nibbles(torch.from_numpy(codes(blocks, kind).reshape(n_rows, -1))),
        "scales": torch.from_numpy(step.reshape(n_rows, -1)),
        "zeros": torch.from_numpy((offset + 8 * step).reshape(n_rows, -1)),
    }
