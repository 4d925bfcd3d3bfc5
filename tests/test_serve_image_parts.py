"""Images in the server's chat requests (Llama 3.2 Vision): OpenAI's `image_url` parts with data URLs, read into the
llama dialog the Python API takes, and refused with a 400 that names the part where they cannot be: a web address
(the server fetches nothing), a damaged data URL, not an image, too many images, or a model that takes none. The app
runs in this process over a stub engine (tests/serve_stub.py): all of this happens before a request reaches one."""

import base64
import io
import time
import zlib

import pytest
from helpers import import_or_skip, png_bytes

import_or_skip("fastapi", "pip install -e '.[serve]'")
import_or_skip("httpx", "pip install -e '.[test]'")
from PIL import Image  # noqa: E402
from serve_stub import MODEL, stub_client  # noqa: E402

from llama.serve.data_urls import image_bytes  # noqa: E402
from llama.serve.prompts import MAX_IMAGE_PIXELS, dialog_of  # noqa: E402
from llama.serve.protocol import APIError, ChatRequest  # noqa: E402
from llama.text import dialog_images  # noqa: E402
from llama.tokenizer import ChatFormat, Tokenizer  # noqa: E402
from llama.vision.batch import MAX_IMAGES  # noqa: E402
from llama.vision.images import open_image  # noqa: E402

PARAM = "messages[2].content[1].image_url.url"


@pytest.fixture(scope="module")
def formatter(tokenizer_path):
    return ChatFormat(Tokenizer(tokenizer_path, version="3.1"))


@pytest.fixture(scope="module")
def vision_client(tokenizer_path):
    return stub_client(tokenizer_path, takes_images=True)


@pytest.fixture(scope="module")
def text_client(tokenizer_path):
    return stub_client(tokenizer_path, takes_images=False)


def jpeg_bytes(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="JPEG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*messages: dict) -> dict:
    return {"model": MODEL, "messages": list(messages)}


def refusal(url: str) -> APIError:
    with pytest.raises(APIError) as refused:
        image_bytes(url, PARAM)
    assert refused.value.status == 400 and refused.value.param == PARAM
    return refused.value


# Data URLs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("media_type", ["image/png", "image/jpeg", "", "application/octet-stream"])
def test_a_data_url_gives_back_the_image_file_it_holds(media_type):
    for image in (png_bytes(7, 5), jpeg_bytes(9, 4)):
        assert image_bytes(data_url(image, media_type), PARAM) == image
    assert image_bytes("DATA:image/png;BASE64," + base64.b64encode(b"x").decode(), PARAM) == b"x"  # any case


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png", "HTTPS://EXAMPLE.COM/A"])
def test_a_web_address_is_refused_saying_to_send_the_image_inline(url):
    message = refusal(url).message
    assert "fetch" in message and "data:" in message and "base64" in message
    assert url in message  # what was refused, recognisably


@pytest.mark.parametrize("url", ["ftp://example.com/cat.png", "file:///etc/passwd", "cat.png", "", "data"])
def test_another_scheme_is_refused_saying_which_url_to_send(url):
    message = refusal(url).message
    assert "data:" in message and "base64" in message


@pytest.mark.parametrize(
    "url", ["data:image/png,iVBORw0KGgo=", "data:image/png;base64", "data:,abc", "data:;base6,QQ=="]
)
def test_a_data_url_without_base64_data_is_refused(url):
    assert "base64" in refusal(url).message


@pytest.mark.parametrize(
    "payload",
    [
        base64.encodebytes(png_bytes(40, 40)).decode(),  # wrapped in lines of 76 characters, as MIME writes it
        base64.b64encode(b"\x89PNG\r\n\x1a").decode().rstrip("="),  # its padding left off
        base64.urlsafe_b64encode(bytes(range(256))).decode(),  # the URL-safe alphabet's - and _
        "iVBORw0KGgo%3D",  # percent-escaped
        "QUJD\u00e9",  # a character outside ASCII
    ],
)
def test_data_that_is_not_strict_base64_is_refused(payload):
    message = refusal("data:image/png;base64," + payload).message
    assert "base64" in message and payload not in message


def test_an_empty_data_url_is_refused():
    assert refusal("data:image/png;base64,").status == 400


@pytest.mark.parametrize("prefix", ["https://example.com/", "ftp://x/", "data:image/png,", "data:;base64,A"])
def test_a_refused_url_of_megabytes_is_cut_short_in_the_error(prefix):
    url = prefix + "A" * 4_000_001
    message = refusal(url).message
    assert len(message) < 1_000


def test_hostile_urls_of_tens_of_megabytes_are_refused_in_linear_time():
    """What a backtracking parser would take quadratic (or worse) time over: long runs of the separators."""
    size = 32 * 2**20
    for url in ["data:" + ";" * size, "data:" + ";base64" * (size // 7), "data:;base64," + "=" * size, "ht" * size]:
        start = time.monotonic()
        refusal(url)
        assert time.monotonic() - start < 5


# Chat messages with images, as a llama dialog ------------------------------------------------------------------


def test_mixed_content_becomes_the_dialog_the_python_api_takes(formatter):
    """Parts keep their order, each image where it stands as one <|image|>, and the dialog's image is the PNG sent."""
    png = png_bytes(12, 8, seed=3)
    request = ChatRequest(
        **chat(
            {"role": "system", "content": "Describe images."},
            {"role": "user", "content": [{"type": "text", "text": "First "}, image_part(data_url(png))]},
            {"role": "assistant", "content": "A square."},
            {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "this? "}]},
        )
    )
    dialog = dialog_of(request, formatter, takes_images=True)
    python_api = [
        {"role": "system", "content": "Describe images."},
        {"role": "user", "content": [{"type": "text", "text": "First "}, {"type": "image", "image": png}]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "and this? "},  # text parts alone: one string, as before images came
    ]
    tokens = formatter.encode_dialog_prompt(dialog)
    assert tokens == formatter.encode_dialog_prompt(python_api)
    image_token = formatter.tokenizer.special_tokens["<|image|>"]
    assert tokens.count(image_token) == 1
    first = formatter.tokenizer.encode("First ", bos=False, eos=False)
    at = tokens.index(image_token)
    assert tokens[at - len(first) : at] == first  # right after the text before it
    ((image,),) = dialog_images([dialog])
    assert image.tobytes() == Image.open(io.BytesIO(png)).convert("RGB").tobytes()


def test_two_images_in_a_message_stand_in_their_order(formatter):
    small, wide = png_bytes(3, 3, seed=1), png_bytes(30, 2, seed=2)
    parts = [image_part(data_url(wide)), {"type": "text", "text": " then "}, image_part(data_url(small))]
    dialog = dialog_of(ChatRequest(**chat({"role": "user", "content": parts})), formatter, takes_images=True)
    assert [image.size for image in dialog_images([dialog])[0]] == [(30, 2), (3, 3)]


def test_a_part_that_is_not_an_image_is_a_400_naming_it(formatter):
    parts = [{"type": "text", "text": "What is this?"}, image_part(data_url(b"GIF89a, or so it says"))]
    request = ChatRequest(
        **chat(
            {"role": "system", "content": "Hi"}, {"role": "user", "content": "x"}, {"role": "user", "content": parts}
        )
    )
    with pytest.raises(APIError) as refused:
        dialog_of(request, formatter, takes_images=True)
    assert refused.value.status == 400 and refused.value.param == PARAM


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header says it is `width` x `height` pixels (its CRC mended), its pixel data a 2x2 image's."""
    data = bytearray(png_bytes(2, 2))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")  # IHDR's first fields
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # over IHDR's type and fields
    return bytes(data)


def test_an_image_over_the_server_s_pixel_limit_is_refused_from_its_header(formatter):
    """A few hundred bytes may claim billions of pixels' worth of memory: the server reads the header and refuses,
    before decoding anything. (Pillow's own limit, 179 million pixels, would let four such images claim 2 GB.)"""
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    request = ChatRequest(**chat({"role": "user", "content": [image_part(data_url(png_claiming(side, side)))]}))
    with pytest.raises(APIError) as refused:
        dialog_of(request, formatter, takes_images=True)
    assert refused.value.status == 400 and refused.value.param == "messages[0].content[0].image_url.url"
    assert f"{side}x{side}" in refused.value.message and "shrink it" in refused.value.message
    with pytest.raises(ValueError, match="cut short|damaged"):  # the Python API: Pillow's limit, and then decoding
        open_image(png_claiming(side, side))


def test_a_model_without_vision_refuses_an_image_naming_the_part(formatter):
    request = ChatRequest(**chat({"role": "user", "content": [image_part(data_url(png_bytes(2, 2)))]}))
    with pytest.raises(APIError) as refused:
        dialog_of(request, formatter)
    assert refused.value.status == 400 and refused.value.param == "messages[0].content[0]"
    assert "image" in refused.value.message


@pytest.mark.parametrize("role", ["assistant", "system", "developer", "tool"])
def test_an_image_outside_a_user_message_is_refused(formatter, role):
    parts = [{"type": "text", "text": "see"}, image_part(data_url(png_bytes(2, 2)))]
    request = ChatRequest(**chat({"role": "user", "content": "Hi"}, {"role": role, "content": parts}))
    with pytest.raises(APIError) as refused:
        dialog_of(request, formatter, takes_images=True)
    assert refused.value.param == "messages[1].content[1]" and "user" in refused.value.message


def test_too_many_images_are_refused_before_any_is_decoded(formatter):
    """Parts that are not images at all: the count is what the error is about, so none of them was opened."""
    parts = [image_part(data_url(b"not an image")) for _ in range(MAX_IMAGES + 1)]
    with pytest.raises(APIError) as refused:
        dialog_of(ChatRequest(**chat({"role": "user", "content": parts})), formatter, takes_images=True)
    assert refused.value.status == 400 and str(MAX_IMAGES) in refused.value.message
    fits = [image_part(data_url(png_bytes(2, 2, seed=k))) for k in range(MAX_IMAGES)]
    dialog = dialog_of(ChatRequest(**chat({"role": "user", "content": fits})), formatter, takes_images=True)
    assert len(dialog_images([dialog])[0]) == MAX_IMAGES


# Over HTTP -----------------------------------------------------------------------------------------------------


def test_a_text_model_s_server_answers_an_image_with_a_400(text_client):
    body = chat({"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(data_url(png_bytes(4, 4)))]})
    for path in ("/v1/chat/completions", "/tokenize"):
        answer = text_client.post(path, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "messages[0].content[1]" and error["type"] == "invalid_request_error"


def test_a_vision_model_s_server_answers_a_bad_image_with_a_400_naming_it(vision_client):
    for url in ("https://example.com/cat.png", data_url(b"plain text")):
        body = chat({"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(url)]})
        answer = vision_client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "messages[0].content[1].image_url.url"


@pytest.mark.parametrize(
    "part, named",
    [
        ({"type": "video", "video": "x"}, "image_url"),  # the types a part may have
        ({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}, "detail"),
        ({"type": "image_url", "url": "data:,"}, "image_url"),  # OpenAI's shape nests the url in image_url
    ],
)
def test_a_malformed_part_is_a_400_that_says_what_is_wrong(vision_client, part, named):
    answer = vision_client.post("/v1/chat/completions", json=chat({"role": "user", "content": [part]}))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert named in error["message"] + error["param"] and "valid string" not in error["message"]


def test_detail_is_taken_and_changes_nothing(vision_client):
    url = data_url(png_bytes(6, 6))
    tokens = [
        vision_client.post("/tokenize", json={"messages": [{"role": "user", "content": [part]}]}).json()["tokens"]
        for part in (
            image_part(url),
            *({"type": "image_url", "image_url": {"url": url, "detail": d}} for d in ("low", "high")),
        )
    ]
    assert tokens[0] == tokens[1] == tokens[2]


def test_the_model_list_says_which_inputs_the_model_takes(vision_client, text_client):
    (vision,) = vision_client.get("/v1/models").json()["data"]
    (text,) = text_client.get("/v1/models").json()["data"]
    assert vision["id"] == text["id"] == MODEL
    assert sorted(vision["input_modalities"]) == ["image", "text"] and text["input_modalities"] == ["text"]


def test_tokenize_counts_one_image_token_per_image(vision_client, formatter):
    png = png_bytes(64, 48)
    parts = [{"type": "text", "text": "What is in "}, image_part(data_url(png))]
    answer = vision_client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    image_token = formatter.tokenizer.special_tokens["<|image|>"]
    assert answer["tokens"].count(image_token) == 1
    python_api = [
        {"role": "user", "content": [{"type": "text", "text": "What is in "}, {"type": "image", "image": png}]}
    ]
    assert answer["tokens"] == formatter.encode_dialog_prompt(python_api)
    assert answer["count"] == len(answer["tokens"])


def test_a_vision_model_s_server_takes_a_body_a_text_model_s_refuses(vision_client, text_client):
    """20 MiB of base64 (the zero bytes of no image): too large for a text model's server; a vision model's reads it
    and finds no image in it."""
    body = chat({"role": "user", "content": [image_part("data:image/png;base64," + "A" * (20 * 2**20))]})
    assert text_client.post("/v1/chat/completions", json=body).status_code == 413
    answer = vision_client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[0].content[0].image_url.url"
