"""Meta's Llama 3.2 Vision reference (llama-models' `llama3.multimodal`), importable on the CPU build of torch.

Meta's code imports torchvision. The torchvision wheel on PyPI is built against CUDA torch: on import it registers
fake (meta-device) implementations of its C++ operators with `torch.library.register_fake`, and where the CPU
build of torch lacks those operators the registration raises RuntimeError and the import fails. The image
transform never calls those operators, so while torchvision is imported here a failed registration is skipped
and the function is returned unregistered. Install torchvision without its dependencies so that pip leaves the
CPU torch alone: `pip install --no-deps torchvision==0.28.0`.
"""

import functools
import importlib
import importlib.util

import torch
from helpers import skip_or_fail


def _require(module: str, install: str) -> None:
    """Skips the calling test (fails it under `$CI`) where `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        skip_or_fail(f"{module} is not installed: {install}")


@functools.cache
def meta_multimodal():
    """Meta's `llama_models.llama3.multimodal.model` module; skips where llama-models or torchvision is missing."""
    _require("llama_models", "pip install llama-models")
    _require("torchvision", "pip install --no-deps torchvision==0.28.0")
    register_fake = torch.library.register_fake

    def lenient(op, func=None, /, *args, **kwargs):
        def register(f):
            try:
                return register_fake(op, f, *args, **kwargs)
            except RuntimeError:  # an operator the CPU build of torch does not have: nothing to register it on
                return f

        return register if func is None else register(func)

    torch.library.register_fake = lenient
    try:
        importlib.import_module("torchvision")
    finally:
        torch.library.register_fake = register_fake
    return importlib.import_module("llama_models.llama3.multimodal.model")


def meta_image_transform():
    """Meta's `VariableSizeImageTransform` class (llama-models' `llama3/multimodal/image_transform.py`)."""
    return meta_multimodal().VariableSizeImageTransform
