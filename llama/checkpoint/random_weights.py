"""Random weights in a checkpoint's full shapes, for the demo checkpoint and for tests: a model to run the whole
path on without real weights."""

import re
from typing import Dict

import torch

from llama.checkpoint.params import model_args_from
from llama.checkpoint.shards import full_shapes
from llama.checkpoint.vision_shapes import full_vision_shapes
from llama.vision.model import vision_args_from

# A vision encoder's LayerNorms (ln_pre, ln_post, ln_1, ln_2): weights near 1 and biases near 0, like RMSNorm's.
LAYER_NORM_WEIGHT = re.compile(r"\.ln_\w+\.weight$")
LAYER_NORM_BIAS = re.compile(r"\.ln_\w+\.bias$")


def random_weights(
    params: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> Dict[str, torch.Tensor]:
    """Random weights with every tensor's full shape (a text model's, or with params.json's vision fields a Llama 3.2
    Vision model's, every gate nonzero), returned on the CPU; norms near 1 so that every layer matters. They are
    drawn on `device`, whose random stream is its own: a GPU draws a large model's weights far faster than the CPU
    (docs/speed.md has the figures)."""
    generator = torch.Generator(device).manual_seed(seed)
    args, _ = model_args_from(params)
    vision = vision_args_from(params, args.n_layers)
    shapes = full_shapes(args) if vision is None else full_vision_shapes(args, vision)
    weights = {}
    for key, shape in shapes.items():
        if key.endswith("norm.weight") or LAYER_NORM_WEIGHT.search(key):
            tensor = 1 + 0.1 * torch.randn(shape, generator=generator, device=device)
        elif LAYER_NORM_BIAS.search(key):
            tensor = 0.1 * torch.randn(shape, generator=generator, device=device)
        else:
            tensor = torch.randn(shape, generator=generator, device=device) / shape[-1] ** 0.5
        weights[key] = tensor.to(device="cpu", dtype=dtype)
    return weights
