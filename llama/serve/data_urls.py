"""An image part's URL turned into the bytes of its image file. The server takes `data:` URLs with base64 only
(RFC 2397: `data:[<media type>][;base64],<data>`), the image sent inline: it fetches nothing, so a request can make
it neither wait on another server nor reach an address that only the server can reach.

The URL is a client's text, up to the body limit's megabytes: it is read with `str.partition` and `startswith`
(linear time, nothing that can backtrack), and an error shows only its first characters.
"""

import base64

from llama.arguments import short_repr
from llama.serve.protocol import APIError

SHOWN_CHARS = 60  # of a refused URL in an error message: enough to recognise it, never a whole image
EXAMPLE = "data:image/png;base64,<the file's bytes in base64>"


def image_bytes(url: str, param: str) -> bytes:
    """The image file that a data URL holds in base64. The media type, if any, is not checked: the image's format
    is read from its bytes (`llama.vision.images.open_image`), as clients often send a generic or missing one.

    The base64 is strict: the standard alphabet (A-Z, a-z, 0-9, + and /) with its = padding, and nothing else, no
    line breaks or spaces either (OpenAI's clients send none; `base64 -w 0` writes none), so that a damaged payload
    is refused rather than decoded into other bytes.

    Raises:
        APIError: 400 naming `param` (`messages[i].content[k].image_url.url`): for an http(s) URL (this server fetches
            nothing), another scheme, a data URL without `;base64` or without a comma before its data, data that is
            not base64 as above, or no data.
    """
    if url[:5].lower() != "data:":  # schemes are case-insensitive (RFC 3986)
        shown = short_repr(url[: SHOWN_CHARS + 1], SHOWN_CHARS)
        if url[:8].lower().startswith(("http://", "https://")):
            message = f"{param} is a web address ({shown}), and this server fetches nothing: send the image inline"
        else:
            message = f"{param} is {shown}; this server takes images as data: URLs only: send the image inline"
        raise APIError(400, f"{message}, as a data: URL with base64: {EXAMPLE}", param)
    header, comma, data = url[5:].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        shown = short_repr(url[: SHOWN_CHARS + 1], SHOWN_CHARS)
        raise APIError(400, f"{param} ({shown}) must be a data URL with base64 data: {EXAMPLE}", param)
    if not data:
        raise APIError(400, f"{param} holds no image: its data after the comma is empty", param)
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as e:  # binascii.Error, or a character outside ASCII
        raise APIError(
            400,
            f"{param}: the data after the comma is not base64 ({e}): encode the image file's bytes in standard base64 "
            "(A-Z, a-z, 0-9, + and /, with = padding), on one line, without spaces",
            param,
        ) from None
