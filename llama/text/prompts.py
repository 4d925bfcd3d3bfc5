"""Text into prompts: the completion calls' texts and dialogs checked and encoded as token IDs, a `ValueError` naming
the one that cannot work. A prompt or a message may also be a list of text and image parts (Llama 3.2 Vision:
`llama.tokenizer.content`); each call's images are given beside its tokens (`prompt_images`, `dialog_images`)."""

from typing import Any, List

from llama.tokenizer import ChatFormat, Dialog, Tokenizer
from llama.tokenizer.content import content_parts, encode_parts, images_of


def encode_prompts(tokenizer: Tokenizer, prompts: List[Any]) -> List[List[int]]:
    """Each prompt's tokens, after a beginning-of-text token; a ValueError names a prompt that cannot work."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings; wrap a single prompt in a list: [prompt]")
    if not prompts:
        raise ValueError("No prompts given; pass a list with at least one prompt")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):  # text and image parts
            try:
                parts = content_parts(prompt)
            except ValueError as e:
                raise ValueError(f"Prompt {i}: {e}") from None
            if not parts:
                raise ValueError(f"Prompt {i} is an empty list of parts; give it at least one")
            encoded.append(encode_parts(tokenizer, parts, bos=True))
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"Prompt {i} is {'empty' if prompt == '' else 'not a string'}: {prompt!r}")
        else:
            encoded.append(tokenizer.encode(prompt, bos=True, eos=False))
    return encoded


def encode_dialogs(formatter: ChatFormat, dialogs: List[Dialog]) -> List[List[int]]:
    """Each dialog in the chat format, ending where the assistant's answer starts; a ValueError names a dialog
    that cannot work."""
    if not dialogs:
        raise ValueError("No dialogs given; pass a list with at least one dialog")
    for i, dialog in enumerate(dialogs):
        if isinstance(dialog, dict):
            raise ValueError("dialogs must be a list of dialogs (lists of messages); wrap one dialog in a list")
        if not dialog:
            raise ValueError(f"Dialog {i} is empty; give it at least one message")
    return [formatter.encode_dialog_prompt(dialog) for dialog in dialogs]


def prompt_images(prompts: List[Any]) -> List[List[Any]]:
    """The images of each prompt (checked by `encode_prompts` first), in order, as given."""
    return [images_of(content_parts(prompt)) if isinstance(prompt, list) else [] for prompt in prompts]


def dialog_images(dialogs: List[Dialog]) -> List[List[Any]]:
    """The images of each dialog's messages (checked by `encode_dialogs` first), in order, as given."""
    return [
        [image for message in dialog for image in images_of(content_parts(message["content"]))] for dialog in dialogs
    ]
