"""Llama 3.2 Vision's image preprocessing (`llama.vision.images`): images cut into tiles exactly as Meta's
`VariableSizeImageTransform` cuts them (bit for bit, for any size, tile size and tile count), images decoded to RGB
as Meta's chat format decodes them, and bad images refused with a clear ValueError or FileNotFoundError."""

import importlib.util
import io
import random
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import skip_or_fail
from hypothesis import example, given, settings
from hypothesis import strategies as st
from meta_vision import meta_image_transform
from PIL import Image, ImageFile

from llama.vision.images import CLIP_MEAN, CLIP_STD, candidate_grids, image_tiles, open_image


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image of random pixels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    return Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())


def encoded(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format)
    return buffer.getvalue()


def meta_decoded(data: bytes) -> Image.Image:
    """The image as Meta's chat format opens it (`_encode_content`)."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def resource(name: str) -> Path:
    """A photo shipped in the llama-models wheel (`llama_models/resources/`), found without importing it."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None:
        skip_or_fail("llama_models is not installed: pip install llama-models")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / name


def same_as_meta(image: Image.Image, tile_size: int, max_tiles: int, dtype: torch.dtype = torch.float32):
    """Our tiles and grid for `image` in `dtype`, after checking that they equal Meta's bit for bit, run with torch's
    default dtype set to `dtype` (as its build sets it to the model's)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        theirs, their_grid = meta_image_transform()(size=tile_size)(image, max_num_chunks=max_tiles)
    finally:
        torch.set_default_dtype(default)
    ours, grid = image_tiles(image, tile_size, max_tiles, dtype)
    assert grid == their_grid
    assert ours.dtype == theirs.dtype == dtype
    assert ours.shape == (grid[0] * grid[1], 3, tile_size, tile_size)
    assert torch.equal(ours, theirs)
    return ours, grid


def normalized(rgb) -> torch.Tensor:
    """The normalized value of one pixel (0..255 per channel), computed here from CLIP's published statistics."""
    return torch.tensor([(v / 255 - m) / s for v, m, s in zip(rgb, CLIP_MEAN, CLIP_STD)])


# --- tiles -------------------------------------------------------------------------------------------------------


def test_the_candidate_grids_are_listed_in_meta_order():
    """The order decides ties, so it is Meta's: for 4 tiles, the order Meta's docstring gives (1x4, 2x2, 1x1, 4x1,
    1x3, 3x1, 1x2, 2x1), and for every count up to 12 the order Meta's code makes."""
    assert candidate_grids(4) == [(1, 4), (2, 2), (1, 1), (4, 1), (1, 3), (3, 1), (1, 2), (2, 1)]
    transform = meta_image_transform()(size=1)
    for max_tiles in range(1, 13):
        assert candidate_grids(max_tiles) == transform.find_supported_resolutions(max_tiles, 1)


@pytest.mark.parametrize(
    "size, grid",
    [
        ((300, 300), (1, 1)),  # smaller than a tile: enlarged into one tile
        ((500, 400), (1, 1)),
        ((1000, 500), (1, 2)),  # 2:1 fills two tiles side by side at 1.12x (so do 3 and 4: the fewest win)
        ((500, 1000), (2, 1)),
        ((1500, 500), (1, 3)),
        ((500, 1500), (3, 1)),
        ((2000, 500), (1, 4)),
        ((500, 2000), (4, 1)),
        ((1000, 1000), (2, 2)),
        ((1300, 1250), (2, 2)),  # larger than every grid: shrunk as little as possible
    ],
)
def test_each_aspect_ratio_gets_its_grid_as_meta_tiles_it(size, grid):
    """At Llama 3.2 Vision's 560-pixel tiles and 4 tiles, images of each shape get the grid that fits them without
    distortion (1, 2, 3 or 4 tiles, across or down), and the very tiles Meta's transform makes."""
    tiles, got = same_as_meta(noise(*size, seed=sum(size)), 560, 4)
    assert got == grid
    assert len(tiles) == grid[0] * grid[1]


def test_a_one_pixel_image_fills_one_tile_with_its_colour():
    """A 1x1 image is enlarged to a whole tile of its one colour, normalized with CLIP's mean and std."""
    image = Image.new("RGB", (1, 1), (200, 100, 50))
    tiles, grid = same_as_meta(image, 28, 4)
    assert grid == (1, 1)
    expected = normalized((200, 100, 50)).view(3, 1, 1).expand(3, 28, 28)
    torch.testing.assert_close(tiles[0], expected, rtol=0, atol=1e-6)


def test_meta_rounds_the_fitted_side_down_one_pixel_short_of_exact():
    """A 100x85 image on a 560-pixel tile is enlarged to 560 wide; exactly, 85 * 5.6 = 476 rows, but Meta computes
    floor(85 * (560 / 100)) = floor(475.99999...) = 475: row 475 is black padding, as in Meta's tiles."""
    tiles, grid = same_as_meta(Image.new("RGB", (100, 85), (255, 255, 255)), 560, 4)
    assert grid == (1, 1)
    white, black = normalized((255, 255, 255)), normalized((0, 0, 0))
    torch.testing.assert_close(tiles[0, :, 474, :], white.view(3, 1).expand(3, 560), rtol=0, atol=1e-6)
    torch.testing.assert_close(tiles[0, :, 475, :], black.view(3, 1).expand(3, 560), rtol=0, atol=1e-6)


def test_the_image_sits_top_left_and_the_tiles_go_row_by_row():
    """A 2x2 grid of four colours, 1120x1120 at 560-pixel tiles: each tile holds one colour, in reading order."""
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    image = Image.new("RGB", (1120, 1120))
    for i, colour in enumerate(colours):
        image.paste(colour, (560 * (i % 2), 560 * (i // 2), 560 * (i % 2 + 1), 560 * (i // 2 + 1)))
    tiles, grid = same_as_meta(image, 560, 4)
    assert grid == (2, 2)
    for tile, colour in zip(tiles, colours):
        torch.testing.assert_close(tile, normalized(colour).view(3, 1, 1).expand(3, 560, 560), rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", [(1200, 30), (30, 1200), (1200, 11), (11, 1200)])
def test_very_wide_and_very_tall_images_tile_as_meta_tiles_them(size):
    tiles, grid = same_as_meta(noise(*size, seed=1), 28, 4)
    assert grid == ((1, 4) if size[0] > size[1] else (4, 1))


@pytest.mark.parametrize("size", [(1200, 1), (1, 1200), (1200, 10)])
def test_an_image_too_thin_for_its_tiles_is_a_clear_error_where_meta_fails_too(size):
    """1200x1 in at most 4 tiles of 28 pixels shrinks its short side to floor(1 * 112 / 1200) = 0 pixels (1200x10
    too: floor(0.93)): Meta's transform fails inside Pillow's resize; ours says why."""
    with pytest.raises(ValueError, match="height and width must be > 0"):
        meta_image_transform()(size=28)(noise(*size), max_num_chunks=4)
    with pytest.raises(ValueError, match=rf"{size[0]}x{size[1]} image is too long and thin.*0 pixels"):
        image_tiles(noise(*size), 28, 4)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA", "1", "I;16"])
def test_other_modes_through_open_image_tile_as_meta_tiles_them(mode):
    """Grayscale, RGBA, palette... PNG files are converted as Meta's chat format converts them, then tiled as Meta
    tiles them."""
    image = noise(90, 60, seed=3)
    image = image.convert(mode) if mode != "P" else image.quantize(16)
    data = encoded(image)
    opened = open_image(data)
    assert opened.mode == "RGB" and opened.size == (90, 60)
    assert opened.tobytes() == meta_decoded(data).tobytes()
    same_as_meta(opened, 56, 3)


def test_a_cmyk_jpeg_opens_as_meta_opens_it():
    data = encoded(noise(40, 30, seed=4).convert("CMYK"), "JPEG")
    assert open_image(data).tobytes() == meta_decoded(data).tobytes()


@pytest.mark.parametrize("name, grid", [("dog.jpg", (1, 1)), ("pasta.jpeg", (2, 2))])
def test_the_photos_shipped_with_llama_models_tile_as_meta_tiles_them(name, grid):
    """dog.jpg (512x512) is enlarged into one 560-pixel tile; pasta.jpeg (1280x1280) is shrunk onto 2x2 tiles."""
    path = resource(name)
    image = open_image(path)
    assert image.tobytes() == meta_decoded(path.read_bytes()).tobytes()
    assert same_as_meta(image, 560, 4)[1] == grid


@settings(max_examples=100, deadline=None)
@given(
    width=st.integers(1, 1200),
    height=st.integers(1, 1200),
    tile_size=st.sampled_from([28, 56, 560]),
    max_tiles=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
@example(width=45, height=50, tile_size=560, max_tiles=4, seed=0)  # floor(50 * 560 / 45) rounds a pixel short
@example(width=1, height=1, tile_size=560, max_tiles=1, seed=0)
def test_any_image_tiles_as_meta_tiles_it(width, height, tile_size, max_tiles, seed):
    """Any size, tile size and tile count: the same tiles bit for bit and the same grid, or, where Meta's transform
    fails (a side shrunk to nothing), a ValueError saying so."""
    image = noise(width, height, seed)
    try:
        meta_image_transform()(size=tile_size)(image, max_num_chunks=max_tiles)
    except ValueError as e:
        assert "height and width must be > 0" in str(e)
        with pytest.raises(ValueError, match="too long and thin"):
            image_tiles(image, tile_size, max_tiles)
        return
    same_as_meta(image, tile_size, max_tiles)


@pytest.mark.parametrize(
    "args, problem",
    [
        ((Image.new("RGB", (0, 0)), 560, 4), "0x0 pixels"),
        ((b"not an image", 560, 4), "takes a PIL image"),
        ((Image.new("RGB", (5, 5)), 0, 4), "tile_size must be a positive integer"),
        ((Image.new("RGB", (5, 5)), 560, 0), "max_tiles must be a positive integer"),
        ((Image.new("RGB", (5, 5)), 560, 2.0), "max_tiles must be a positive integer"),
    ],
)
def test_image_tiles_refuses_bad_arguments_clearly(args, problem):
    with pytest.raises(ValueError, match=problem):
        image_tiles(*args)


# --- opening images ----------------------------------------------------------------------------------------------


def test_a_path_bytes_and_a_pil_image_open_to_the_same_rgb_pixels(tmp_path):
    for image, format in ((noise(33, 21, seed=5), "PNG"), (noise(33, 21, seed=6).convert("L"), "JPEG")):
        data = encoded(image, format)
        path = tmp_path / f"image.{format.lower()}"
        path.write_bytes(data)
        opened = [open_image(path), open_image(str(path)), open_image(data), open_image(bytearray(data))]
        opened.append(open_image(Image.open(io.BytesIO(data))))
        for each in opened:
            assert each.mode == "RGB" and each.size == (33, 21)
            assert each.tobytes() == meta_decoded(data).tobytes()


def test_a_pil_image_given_is_not_changed():
    image = noise(8, 8).convert("RGBA")
    opened = open_image(image)
    assert image.mode == "RGBA" and opened.mode == "RGB" and opened is not image


def valid_png() -> bytes:
    return encoded(noise(64, 64, seed=7))


def valid_jpeg() -> bytes:
    return encoded(noise(64, 64, seed=8), "JPEG")


@pytest.mark.parametrize(
    "data, problem",
    [
        (random.Random(0).randbytes(1000), "not an image file Pillow can read"),
        (b"", "The 0 bytes given is not an image file"),
        (valid_png()[: len(valid_png()) // 2], "could not be decoded.*truncated"),
        (valid_jpeg()[: len(valid_jpeg()) // 2], "could not be decoded.*truncated"),
        (valid_png()[:40], "not an image file Pillow can read, or its header is damaged or cut short"),
    ],
    ids=["random bytes", "empty", "truncated PNG", "truncated JPEG", "PNG header only"],
)
def test_bad_image_bytes_are_a_value_error_naming_the_problem(data, problem):
    with pytest.raises(ValueError, match=problem):
        open_image(data)
    assert not ImageFile.LOAD_TRUNCATED_IMAGES  # Pillow's settings are left alone


def test_a_truncated_file_opened_lazily_by_pil_fails_in_open_image():
    """Image.open reads only the header; open_image decodes everything, so the damage shows here, not later."""
    lazy = Image.open(io.BytesIO(valid_png()[:-200]))
    with pytest.raises(ValueError, match="The PIL image given could not be decoded.*truncated"):
        open_image(lazy)


@pytest.mark.parametrize("size", [(0, 0), (0, 5), (5, 0)])
def test_an_image_without_pixels_is_a_value_error(size):
    with pytest.raises(ValueError, match=f"{size[0]}x{size[1]} pixels: an image needs at least one pixel"):
        open_image(Image.new("RGB", size))


def test_a_decompression_bomb_is_a_value_error_saying_so(monkeypatch, tmp_path):
    """Pillow's own limit is kept: an image of more than twice `Image.MAX_IMAGE_PIXELS` pixels is refused."""
    data = encoded(noise(20, 20))  # 400 pixels
    path = tmp_path / "bomb.png"
    path.write_bytes(data)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for source in (data, path):
        with pytest.raises(ValueError, match="decompression bomb.*MAX_IMAGE_PIXELS"):
            open_image(source)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)
    assert open_image(data).size == (20, 20)


@pytest.mark.parametrize("source", [5, {"image": b""}, None, [b"\x89PNG"], 1.5])
def test_a_wrong_type_is_a_value_error_naming_it(source):
    with pytest.raises(
        ValueError, match=f"takes a PIL image, the bytes of an image file or a path, not {type(source).__name__}"
    ):
        open_image(source)


def test_a_missing_path_is_file_not_found_naming_it(tmp_path):
    missing = tmp_path / "no such image.png"
    for source in (missing, str(missing), tmp_path):
        with pytest.raises(FileNotFoundError, match="No image file at .*check the path") as error:
            open_image(source)
        assert str(source) in str(error.value)


def seed_files():
    """Small valid files in several formats, for the fuzz test to damage."""
    image = noise(12, 9, seed=9)
    return [encoded(image, format) for format in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "PPM")]


SEEDS = seed_files()


def damaged(data: bytes, cut: int, flips: dict) -> bytes:
    """`data` cut to its first `cut` bytes (all of it if `cut` is 0), with byte i XORed with flips[i]."""
    data = bytearray(data[:cut] if cut else data)
    for i, mask in flips.items():
        if i < len(data):
            data[i] ^= mask
    return bytes(data)


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.builds(
            damaged,
            st.sampled_from(SEEDS),
            st.integers(0, 400),
            st.dictionaries(st.integers(0, 120), st.integers(1, 255), max_size=4),
        ),
    )
)
def test_arbitrary_bytes_give_an_rgb_image_or_a_value_error(data):
    """Random bytes, and valid files cut short or with bytes flipped: open_image returns an RGB image with pixels,
    or raises ValueError, never another exception from inside Pillow."""
    with mock.patch.object(Image, "MAX_IMAGE_PIXELS", 1_000_000), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow warns of the damage it skips over (and of large images)
        try:
            image = open_image(data)
        except ValueError:
            return
    assert image.mode == "RGB" and image.width > 0 and image.height > 0
    assert len(image.tobytes()) == 3 * image.width * image.height


@settings(max_examples=40)
@given(width=st.integers(1, 1200), height=st.integers(1, 1200), max_tiles=st.integers(1, 4), seed=st.integers(0, 9))
@example(width=561, height=53, max_tiles=4, seed=0)  # bfloat16 reads 561 as 560: one tile, where float32 gives two
@example(width=561, height=1, max_tiles=4, seed=0)
def test_in_bfloat16_images_tile_as_metas_bfloat16_build_tiles_them(width, height, max_tiles, seed):
    """A bfloat16 model's tiles: Meta's build runs its transform with torch's default dtype set to bfloat16, which
    rounds the grid's ratios and the pixels; ours, given the dtype, gives the same grid and tiles bit for bit."""
    image = noise(width, height, seed)
    try:
        same_as_meta(image, 560, max_tiles, torch.bfloat16)
    except ValueError as e:  # a side shrunk to nothing: Meta's transform fails, and so does ours (see above)
        assert "height and width must be > 0" in str(e) or "too long and thin" in str(e)


def test_bfloat16_changes_the_grid_of_some_images():
    """Why the dtype is passed: 561x53 pixels fits 1 tile of 560 in bfloat16, 2 in float32."""
    image = noise(561, 53, 0)
    assert image_tiles(image, 560, 4, torch.bfloat16)[1] != image_tiles(image, 560, 4)[1]
