"""What a load tells a person who waits: a progress bar while weights are read or written, and the line that says
what was loaded, and how.

The bar is drawn on stderr, by rank 0 only, and only when stderr is a terminal: nothing here prints to stdout.
"""

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, TypeVar

import torch

T = TypeVar("T")

BAR_DELAY = 1.0  # seconds a load runs before its bar appears: a quick load draws none

FORMAT_NAMES = {"meta": "Meta", "hf": "Hugging Face", "gguf": "GGUF"}  # a checkpoint format, as people say it


@dataclass
class LoadReport:
    """What `Llama.build` chose and loaded, and how long it took; its text is the line shown after loading."""

    format: str  # "meta", "hf" or "gguf"
    device: torch.device
    dtype: torch.dtype
    quantization: Optional[str]  # "int8", "int4" or None
    stored_quantized: bool  # the checkpoint holds quantized weights (`python -m llama.convert quantize`)
    model_parallel_size: int
    seconds: float
    note: Optional[str] = None  # the checkpoint's own word on its weights (`CheckpointReader.load_note`)
    kernels: Optional[str] = None  # the kernels the products run on (`llama.runtime.parallel_layers.kernels_in_use`)
    vision: bool = False  # a Llama 3.2 Vision model (`llama.vision`): images and text in

    def __str__(self) -> str:
        layout = FORMAT_NAMES.get(self.format, self.format)
        if self.quantization is None:
            quantized = "not quantized"
        else:
            quantized = f"{self.quantization} ({'stored' if self.stored_quantized else 'quantized at load'})"
        dtype = str(self.dtype).removeprefix("torch.")
        kernels = f"\nKernels, by rows per call: {self.kernels}" if self.kernels else ""
        return (
            f"Loaded in {self.seconds:.2f} seconds: {layout} checkpoint"
            f"{' of a vision model (Llama 3.2 Vision: images and text in)' if self.vision else ''}, "
            f"device {self.device}, dtype {dtype}, "
            f"{quantized}, model-parallel size {self.model_parallel_size}{f'; {self.note}' if self.note else ''}"
            f"{kernels}"
        )


def weights_bar(items: Iterable[T], total: int, rank: Optional[int], what: str = "Loading weights") -> Iterator[T]:
    """`items` as they come, with a tqdm bar on stderr once they take more than BAR_DELAY seconds, on rank 0 and
    where stderr is a terminal (a log file or a pipe gets no bar; rank None: no bar)."""
    if rank != 0 or not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm  # only where a bar can be drawn

    with tqdm(items, total=total, desc=what, unit="tensor", delay=BAR_DELAY, leave=False, file=sys.stderr) as bar:
        yield from bar
