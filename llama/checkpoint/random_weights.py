"""Random weights in a checkpoint's full shapes, for the demo checkpoint and for tests: a model to run the whole
path on without real weights."""

from typing import Dict

import torch

from llama.checkpoint.shards import full_shapes
from llama.model import ModelArgs


def random_weights(
    params: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> Dict[str, torch.Tensor]:
    """Random weights with every tensor's full shape, returned on the CPU; norms near 1 so that every layer
    matters. They are drawn on `device`, whose random stream is its own: a GPU draws a large model's weights far
    faster than the CPU (docs/speed.md has the figures)."""
    generator = torch.Generator(device).manual_seed(seed)
    args = ModelArgs(**params)
    weights = {}
    for key, shape in full_shapes(args).items():
        if key.endswith("norm.weight"):
            tensor = 1 + 0.1 * torch.randn(shape, generator=generator, device=device)
        else:
            tensor = torch.randn(shape, generator=generator, device=device) / shape[-1] ** 0.5
        weights[key] = tensor.to(device="cpu", dtype=dtype)
    return weights
