"""Meta's Llama 3.2 Vision reference (llama-models' `llama3.multimodal`), importable without torchvision.

Meta's image transform imports torchvision for three steps on a PIL image: `F.resize` (which, for a PIL image, is
PIL's own `Image.resize` to (width, height) with the given filter), `ToTensor` (the uint8 pixels, channels first, in
torch's default dtype, divided by 255) and `Normalize` (minus the mean, over the standard deviation, per channel).
torchvision's PyPI wheel cannot be used here: it is built for CUDA torch, its operators fail to register beside
the CPU build, and once installed it breaks `import transformers` (which imports it where it is installed). So
those three steps are written below as torchvision documents them, and put in place of torchvision only while
Meta's modules import; everything else, the canvas choice, the sizes, the padding and the tiles, is Meta's own code.
"""

import enum
import functools
import importlib
import importlib.util
import sys
import types

import numpy as np
import torch
from helpers import skip_or_fail
from PIL import Image


class InterpolationMode(enum.Enum):
    BILINEAR = Image.Resampling.BILINEAR


def resize(image: Image.Image, size, interpolation=InterpolationMode.BILINEAR) -> Image.Image:
    """torchvision's `F.resize` of a PIL image to `size` (height, width)."""
    height, width = size
    return image.resize((width, height), interpolation.value)


class ToTensor:
    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = torch.from_numpy(np.array(image, np.uint8, copy=True))  # (height, width, channels)
        return pixels.permute(2, 0, 1).contiguous().to(torch.get_default_dtype()).div(255)


class Normalize:
    def __init__(self, mean, std, inplace: bool = False):
        self.mean, self.std, self.inplace = mean, std, inplace

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=x.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype).view(-1, 1, 1)
        x = x if self.inplace else x.clone()
        return x.sub_(mean).div_(std)


def torchvision_stand_in() -> dict:
    """The modules Meta's image transform imports from torchvision, holding the three steps above."""
    package = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    functional.resize = resize
    transforms.ToTensor, transforms.Normalize, transforms.InterpolationMode = ToTensor, Normalize, InterpolationMode
    transforms.functional = functional
    package.transforms = transforms
    return {
        "torchvision": package,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
    }


@functools.cache
def meta_multimodal():
    """Meta's `llama_models.llama3.multimodal.model` module; skips where llama-models is missing."""
    if importlib.util.find_spec("llama_models") is None:
        skip_or_fail("llama_models is not installed: pip install llama-models")
    stand_in = torchvision_stand_in()
    saved = {name: sys.modules[name] for name in stand_in if name in sys.modules}
    sys.modules.update(stand_in)
    try:
        return importlib.import_module("llama_models.llama3.multimodal.model")
    finally:  # nothing else in this process sees the stand-in
        for name in stand_in:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def meta_image_transform():
    """Meta's `VariableSizeImageTransform` class (llama-models' `llama3/multimodal/image_transform.py`)."""
    return meta_multimodal().VariableSizeImageTransform
