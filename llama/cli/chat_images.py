"""Images in the terminal chat (Llama 3.2 Vision): what `/image PATH` attaches, the image files a message names, and
the images of a dialog that `/save` writes and `/load` reads back.

An image file named in a message is attached to it by this rule, on a vision model only: a word of the message that
names an existing file with an image extension (`IMAGE_EXTENSIONS`, any case), relative to the current folder or,
starting with `~/`, to the home folder. A word is a run of characters between spaces, less the punctuation that may
open or close a sentence or a bracket around it (`What is in ~/photos/dog.jpg?`); or, for a path with spaces, the
text between a pair of double or single quotes, the first opening a word, the second closing one (`"my photos/dog
1.png"`). Each file is attached once, in the order first named, and the text is sent as typed. A word that names no
such file is text, as is every word on a text model.

In the dialog an image part is `{"type": "image", "image": <the decoded image>, "path": <its absolute path>}`:
decoded once, when attached, so that a later turn does not read the file again; "path" is what `/save` writes in
the image's place (`saved_dialog`), and `/load` decodes the file again (`opened_dialog`).
"""

import os
import re
from typing import Any, Dict, Iterator, List, Union

from llama.tokenizer import Message
from llama.vision.images import open_image
from llama.vision.model import CrossAttentionTransformer

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff")
QUOTES = "\"'"
OPENING = "([{<\"'"  # may stand before a path in a sentence, and is not part of it
CLOSING = ".,;:!?)]}>\"'"  # may end a sentence or a bracket after a path
# A quote that closes a quoted path: one followed by a space, punctuation that may end a sentence, or the end.
CLOSING_QUOTE = {quote: re.compile(re.escape(quote) + r"(?=[\s.,;:!?)\]}>]|\Z)") for quote in QUOTES}
NON_SPACE = re.compile(r"\S+")
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer word names no file, and is not looked up

ImagePart = Dict[str, Any]


def takes_images(generator) -> bool:
    """Whether `generator` (a `Llama`) runs a Llama 3.2 Vision model."""
    return isinstance(generator.model, CrossAttentionTransformer)


def words(text: str) -> Iterator[str]:
    """The words of `text`, left to right: a quoted span (quotes removed) where a quote opens a word and the same
    quote closes one later (before a space, punctuation or the end: the apostrophe of `it's` closes nothing), else
    a run of characters other than whitespace, less `OPENING` and `CLOSING` punctuation at its ends.

    One pass, in time linear in len(text) however it is written: each character is read a bounded number of times
    (a quoted span's first word twice), except that a quote that is never closed makes the search for its partner
    read the rest of the text; that happens at most once for each kind of quote, as a later quote of that kind has
    no partner either (`unclosed`).
    """
    i, unclosed = 0, set()
    while True:
        word = NON_SPACE.search(text, i)
        if word is None:
            return
        i = word.start()
        if text[i] in QUOTES and text[i] not in unclosed:
            partner = CLOSING_QUOTE[text[i]].search(text, i + 1)
            if partner:
                yield text[i + 1 : partner.start()]
                i = partner.end()
                continue
            unclosed.add(text[i])
        yield word.group().lstrip(OPENING).rstrip(CLOSING)
        i = word.end()


def image_paths_in(text: str) -> List[str]:
    """The absolute paths of the image files `text` names (the rule in the module's docstring), each once, in the
    order first named."""
    looked_up = set()  # words already looked at: a word named again costs no second look
    paths: Dict[str, bool] = {}  # whether each path is a file
    for word in words(text):
        if word in looked_up or len(word) > MAX_PATH_CHARS or not word.lower().endswith(IMAGE_EXTENSIONS):
            continue  # decided without touching the disk: most words end here
        looked_up.add(word)
        # `~/` only: `~name/` would look a user up, maybe over the network, once for each such word
        path = os.path.abspath(os.path.expanduser(word) if word.startswith("~/") else word)
        if path not in paths:
            paths[path] = os.path.isfile(path)  # False, not an error, for a name the OS refuses
    return [path for path, is_file in paths.items() if is_file]


def open_attachment(path: str) -> ImagePart:
    """The image part of the image file at `path` (`~` expanded, relative to the current folder).

    Raises:
        ValueError: one line saying what is wrong: no such file, not an image, truncated or damaged, unreadable.
    """
    full = os.path.abspath(os.path.expanduser(path))
    try:
        image = open_image(full)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    except OSError as e:  # a file that is there but cannot be read (permissions)
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    return {"type": "image", "image": image, "path": full}


def images_named_in(text: str) -> List[ImagePart]:
    """The image parts of the files `text` names; a ValueError for the first that is not a readable image."""
    return [open_attachment(path) for path in image_paths_in(text)]


def unquoted(argument: str) -> str:
    """A command's argument without the quotes around it (`/image "my photo.png"`)."""
    if len(argument) >= 2 and argument[0] in QUOTES and argument[-1] == argument[0]:
        return argument[1:-1]
    return argument


def described(part: ImagePart) -> str:
    """How the chat names an attached image: `image: dog.jpg, 1200x800`."""
    return f"image: {os.path.basename(part['path'])}, {part['image'].width}x{part['image'].height}"


def user_content(text: str, images: List[ImagePart]) -> Union[str, List[dict]]:
    """A user message's content: the text alone, or the images first and then the text, as Llama 3.2 Vision's prompts
    put them."""
    return [*images, {"type": "text", "text": text}] if images else text


def image_count(dialog: List[Message]) -> int:
    """How many image parts the messages of `dialog` hold."""
    return sum(
        1
        for message in dialog
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    )


def saved_dialog(dialog: List[Message]) -> List[Message]:
    """`dialog` as JSON can hold it: each image part as `{"type": "image", "image": its path}`, which
    `chat_completion` also takes."""

    def saved(part: dict) -> dict:
        return {"type": "image", "image": part["path"]} if part.get("type") == "image" else part

    return [
        {**message, "content": [saved(part) for part in message["content"]]}
        if isinstance(message["content"], list)
        else message
        for message in dialog
    ]


def opened_dialog(dialog: List[Message], path: str) -> List[Message]:
    """A dialog read from the file `path` (by `llama.cli.chat_input.load_dialog`), each image part's file decoded.

    Raises:
        ValueError: naming the message whose image cannot be read, and why.
    """
    opened = []
    for i, message in enumerate(dialog):
        if isinstance(message["content"], list):
            parts = []
            for part in message["content"]:
                try:
                    parts.append(open_attachment(part["image"]) if part["type"] == "image" else part)
                except ValueError as e:
                    raise ValueError(f"message {i} of {path}: {e}") from None
            message = {**message, "content": parts}
        opened.append(message)
    return opened
