"""Text into prompts: the completion calls' texts and dialogs checked and encoded as token IDs, a `ValueError` naming
the one that cannot work."""

from typing import List

from llama.tokenizer import ChatFormat, Dialog, Tokenizer


def encode_prompts(tokenizer: Tokenizer, prompts: List[str]) -> List[List[int]]:
    """Each prompt's tokens, after a beginning-of-text token; a ValueError names a prompt that cannot work."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings; wrap a single prompt in a list: [prompt]")
    if not prompts:
        raise ValueError("No prompts given; pass a list with at least one prompt")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"Prompt {i} is {'empty' if prompt == '' else 'not a string'}: {prompt!r}")
    return [tokenizer.encode(x, bos=True, eos=False) for x in prompts]


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
