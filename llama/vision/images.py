"""Images in, tiles out: Llama 3.2 Vision's image preprocessing, as Meta's reference does it.

The vision encoder sees an image as a few square tiles (560x560 pixels each for Llama 3.2 Vision, at most 4 of
them). An image of any size is fitted into the grid of tiles that suits its shape best, without distorting it:

1. `open_image` decodes an image file and converts it to RGB, as Meta's chat format does.
2. `best_canvas` picks the grid: among every grid of at most `max_tiles` tiles, the one that needs the least
   upscaling, or, if every grid needs shrinking, the least shrinking; on a tie, the grid with the fewest tiles.
3. `fitted_size` resizes the image to fill that canvas along one side, keeping its aspect ratio (and enlarging
   a small image only up to one tile's side).
4. `image_tiles` pastes the resized image at the top-left of a black canvas, scales pixels to [0, 1], normalizes
   them with CLIP's mean and standard deviation, and cuts the canvas into tiles, row by row.

Everything matches `VariableSizeImageTransform` in Meta's llama-models bit for bit, including its rounding: the
grid is chosen with float32 ratios, and the resized side is `floor(side * ratio)` in float64, which is sometimes
one pixel short of the exact value (a 100x85 image fitted to 560 pixels wide becomes 560x475, not 560x476). Only
Pillow and torch are used (Meta's code calls torchvision for the same PIL resize, ToTensor and Normalize steps).
"""

import io
import math
import os
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch
from PIL import Image

# The mean and standard deviation of each RGB channel that CLIP's image encoder was trained with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

ImageSource = Union[Image.Image, bytes, bytearray, str, os.PathLike]


def open_image(source: ImageSource, max_pixels: Optional[int] = None) -> Image.Image:
    """Decodes an image and converts it to RGB, as Meta's chat format does (`.convert("RGB")`).

    Args:
        source: A PIL image, the bytes of an image file, or the path of one.
        max_pixels: A file's most pixels (width times height), checked on its header before anything is decoded
            (the server's bound on the memory one image takes); None: Pillow's own limit only.

    Returns:
        A fully decoded RGB image (a new one, even when `source` is already RGB).

    Raises:
        FileNotFoundError: If `source` is a path with no file at it.
        ValueError: If `source` is not an image Pillow can read, is truncated or corrupt, has no pixels, is larger
            than `PIL.Image.MAX_IMAGE_PIXELS` allows (a possible decompression bomb) or than `max_pixels`, or is of
            another type.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"No image file at {str(path)!r}: check the path.")
        name = f"The file {str(path)!r}"
        try:
            image = path.read_bytes()
        except OSError as e:  # unreadable: permissions, a device, an I/O error
            raise ValueError(f"{name} cannot be read ({e.strerror or e}): check its permissions.") from e
    elif isinstance(source, (bytes, bytearray)):
        image, name = bytes(source), f"The {len(source)} bytes given"
    elif isinstance(source, Image.Image):
        image, name = source, "The PIL image given"
    else:
        raise ValueError(
            f"open_image takes a PIL image, the bytes of an image file or a path, not {type(source).__name__}."
        )
    try:
        if isinstance(image, bytes):
            image = Image.open(io.BytesIO(image))  # reads the header only
        too_large = max_pixels is not None and image.width * image.height > max_pixels
        if not too_large:
            image.load()  # decodes the pixels, so that a truncated file fails here and not later
            image = image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ValueError(
            f"{name} is too large to decode safely, a possible decompression bomb ({e}). If you trust it, raise "
            "PIL.Image.MAX_IMAGE_PIXELS, or shrink the image first."
        ) from e
    except Image.UnidentifiedImageError as e:
        raise ValueError(
            f"{name} is not an image file Pillow can read, or its header is damaged or cut short: pass a PNG, JPEG, "
            "GIF, WebP... file."
        ) from e
    except Exception as e:  # Pillow reports damaged data as OSError, SyntaxError, EOFError, struct.error...
        raise ValueError(
            f"{name} could not be decoded as an RGB image, it may be truncated or damaged ({type(e).__name__}: {e}): "
            "pass a complete, undamaged image file."
        ) from e
    if too_large:
        raise ValueError(
            f"{name} is a {image.width}x{image.height} image, over the {max_pixels:,} pixels allowed here: shrink it "
            "first (Llama 3.2 Vision reads at most 4 tiles of 560 pixels)."
        )
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{name} is {image.width}x{image.height} pixels: an image needs at least one pixel.")
    return image


def candidate_grids(max_tiles: int) -> List[Tuple[int, int]]:
    """Every grid of at most `max_tiles` tiles, as (tiles_wide, tiles_high), in the order Meta's code lists them.

    That order decides which of several equally good grids wins, so it is kept: tile counts from `max_tiles` down
    to 1, grids of the same shape (width/height ratio) together, in the order each shape first appears.
    """
    by_shape = {}
    for count in range(max_tiles, 0, -1):
        for wide in range(1, count + 1):
            if count % wide == 0:
                by_shape.setdefault(wide / (count // wide), []).append((wide, count // wide))
    return [grid for grids in by_shape.values() for grid in grids]


def best_canvas(
    width: int, height: int, tile_size: int, max_tiles: int, dtype: torch.dtype = torch.float32
) -> Tuple[int, int]:
    """The (width, height) in pixels of the tile grid that an image of `width` x `height` pixels fits best.

    The best grid needs the smallest scale factor >= 1 to fill it (without distortion), or, when every grid is
    smaller than the image, the largest factor < 1; among grids with that same factor, the one with the fewest
    tiles (the first listed, if two have as many).
    """
    canvases = torch.tensor(candidate_grids(max_tiles)) * tile_size
    # Ratios in `dtype`, as Meta's code computes them (integer tensor / int, in torch's default dtype, which its
    # build sets to the model's): the same numbers give the same ties. In bfloat16, 561 reads as 560.
    sides = canvases.to(dtype)
    scales = torch.minimum(
        sides[:, 0] / torch.tensor(width, dtype=dtype), sides[:, 1] / torch.tensor(height, dtype=dtype)
    )
    enlarging = scales[scales >= 1]
    scale = enlarging.min() if len(enlarging) else scales.max()
    fits = canvases[scales == scale]
    best = fits[torch.argmin(fits[:, 0] * fits[:, 1])]  # argmin takes the first of equal areas
    return tuple(best.tolist())


def fitted_size(width: int, height: int, canvas: Tuple[int, int], tile_size: int) -> Tuple[int, int]:
    """The (width, height) an image is resized to on `canvas` (width, height): as large as fits without changing
    its aspect ratio, in a box whose sides are the canvas's, or the larger of the image's own side and `tile_size`
    where that is smaller (so a small image is enlarged to about one tile, not to the whole canvas)."""
    target_w = min(max(width, tile_size), canvas[0])
    target_h = min(max(height, tile_size), canvas[1])
    scale_w, scale_h = target_w / width, target_h / height
    # Meta's float64 arithmetic, floor included: 85 * (560 / 100) gives 475, where 85 * 560 // 100 is 476.
    if scale_w < scale_h:
        return target_w, min(math.floor(height * scale_w), target_h)
    return min(math.floor(width * scale_h), target_w), target_h


def image_tiles(
    image: Image.Image, tile_size: int, max_tiles: int, dtype: torch.dtype = torch.float32
) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """Cuts an image into normalized tiles for the vision encoder, as Meta's
    `VariableSizeImageTransform(size=tile_size)(image, max_num_chunks=max_tiles)` does with torch's default dtype
    set to `dtype` (Meta's build sets it to the model's dtype, and its transform computes in it).

    Args:
        image: The image, RGB as `open_image` returns it (other modes go through the same steps as in Meta's code).
        tile_size: The side of a square tile in pixels (560 for Llama 3.2 Vision).
        max_tiles: The most tiles to use (4 for Llama 3.2 Vision).
        dtype: The floating-point dtype of the grid's ratios and of the pixels: the model's.

    Returns:
        The tiles, of shape (tiles_high * tiles_wide, 3, tile_size, tile_size) in `dtype`, row by row from the
        top-left, and the grid (tiles_high, tiles_wide).

    Raises:
        ValueError: If `tile_size` or `max_tiles` is not a positive integer, the image has no pixels, or it is so
            long and thin that its short side would shrink to nothing (Meta's code fails there too).
    """
    for name, value in (("tile_size", tile_size), ("max_tiles", max_tiles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}.")
    if not isinstance(image, Image.Image):
        raise ValueError(f"image_tiles takes a PIL image (see open_image), not {type(image).__name__}.")
    if image.width == 0 or image.height == 0:
        raise ValueError(f"The image is {image.width}x{image.height} pixels: an image needs at least one pixel.")

    canvas_w, canvas_h = best_canvas(image.width, image.height, tile_size, max_tiles, dtype)
    size = fitted_size(image.width, image.height, (canvas_w, canvas_h), tile_size)
    if 0 in size:
        raise ValueError(
            f"A {image.width}x{image.height} image is too long and thin for {max_tiles} tile(s) of {tile_size} "
            f"pixels: its short side would shrink to {min(size)} pixels. Crop it, or allow more tiles."
        )
    padded = Image.new("RGB", (canvas_w, canvas_h))  # black
    padded.paste(image.resize(size, Image.Resampling.BILINEAR))  # at the top-left

    pixels = torch.frombuffer(bytearray(padded.tobytes()), dtype=torch.uint8).view(canvas_h, canvas_w, 3)
    x = pixels.permute(2, 0, 1).contiguous().to(dtype).div(255)
    x.sub_(torch.tensor(CLIP_MEAN, dtype=dtype).view(3, 1, 1)).div_(torch.tensor(CLIP_STD, dtype=dtype).view(3, 1, 1))

    high, wide = canvas_h // tile_size, canvas_w // tile_size
    tiles = x.view(3, high, tile_size, wide, tile_size).permute(1, 3, 0, 2, 4)
    return tiles.reshape(high * wide, 3, tile_size, tile_size), (high, wide)
