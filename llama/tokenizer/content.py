"""A message's content, or a completion prompt: a string, or a list of parts, text and images in order (Llama 3.2
Vision). Each image stands in the tokens as one `<|image|>`; the images themselves go to the vision model
(`llama.vision`)."""

from typing import Any, List, Union

from llama.arguments import short_repr
from llama.tokenizer.bpe import Tokenizer

IMAGE_TOKEN = "<|image|>"


class ImagePart:
    """An image part's image, as given: a PIL image, an image file's bytes or its path."""

    def __init__(self, image: Any):
        self.image = image


Part = Union[str, ImagePart]


def content_parts(content: Any) -> List[Part]:
    """`content` as its parts: a string is one text part; a list holds {"type": "text", "text": str} and
    {"type": "image", "image": a PIL image, bytes or a path} dicts.

    Raises:
        ValueError: for content of another type, or a part of another shape, named by its index.
    """
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(  # noqa: TRY004 (ValueError, like every other malformed-message error)
            f"Content must be a str or a list of parts, got {type(content).__name__}"
        )
    parts: List[Part] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "image" and "image" in part:
            parts.append(ImagePart(part["image"]))
        else:
            raise ValueError(
                f'Content part {index} must be {{"type": "text", "text": str}} or {{"type": "image", "image": '
                f"a PIL image, bytes or a path}}, got {short_repr(part)}"
            )
    return parts


def image_token(tokenizer: Tokenizer) -> int:
    """The `<|image|>` token, or a ValueError where the tokenizer has none (a Llama 3 tokenizer: version "3")."""
    if IMAGE_TOKEN not in tokenizer.special_tokens:
        raise ValueError(
            f'Images need a Llama 3.2 Vision model and its tokenizer (version="3.1"), which has {IMAGE_TOKEN}'
        )
    return tokenizer.special_tokens[IMAGE_TOKEN]


def encode_parts(tokenizer: Tokenizer, parts: List[Part], bos: bool) -> List[int]:
    """The tokens of `parts`: each text encoded on its own, as given (llama-models' chat format), each image as
    `<|image|>`; with `bos`, `<|begin_of_text|>` first."""
    tokens = [tokenizer.bos_id] if bos else []
    for part in parts:
        if isinstance(part, ImagePart):
            tokens.append(image_token(tokenizer))
        else:
            tokens.extend(tokenizer.encode(part, bos=False, eos=False))
    return tokens


def images_of(parts: List[Part]) -> List[Any]:
    """The images of `parts`, in order, as given."""
    return [part.image for part in parts if isinstance(part, ImagePart)]
