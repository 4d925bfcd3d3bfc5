"""A draft model for speculative decoding (`Llama.build(draft=...)`): its checkpoint checked before the model loads,
then loaded as the model is and run on the runtime's modules."""

import os
from typing import Optional

from llama.arguments import LOOKUP
from llama.checkpoint.load import load_checkpoint, open_checkpoint
from llama.checkpoint.params import model_args_from
from llama.runtime import RuntimeTransformer, for_runtime


def draft_vocabulary(draft) -> Optional[int]:
    """The vocabulary size of a draft checkpoint folder (None for no draft, or prompt lookup), read from its params
    before anything loads, so that a wrong draft fails first.

    Raises:
        ValueError: for a draft that is neither a folder nor "lookup".
        FileNotFoundError: for a folder that holds no checkpoint.
    """
    if draft is None or draft == LOOKUP:
        return None
    if not isinstance(draft, (str, os.PathLike)):
        raise ValueError(f"draft must be {LOOKUP!r}, a checkpoint folder or None, got {draft!r}")
    try:
        args, _ = model_args_from(open_checkpoint(draft).params)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"The draft: {e} (a draft is {LOOKUP!r} or a checkpoint folder)") from None
    return args.vocab_size


def draft_model(ckpt_dir: str, vocab_size: int, model: RuntimeTransformer, *load_args) -> RuntimeTransformer:
    """The draft model of speculative decoding: the checkpoint in `ckpt_dir` (of `vocab_size` tokens), loaded as
    `load_checkpoint` loads one (`load_args`, with `model`'s tokenizer) and run eagerly on the runtime's modules.

    Raises:
        ValueError: when its vocabulary is not `model`'s (a draft must share the model's tokenizer).
    """
    if vocab_size != model.vocab_size:
        raise ValueError(
            f"The draft checkpoint {ckpt_dir} has a vocabulary of {vocab_size} tokens and the model "
            f"{model.vocab_size}: a draft must share the model's tokenizer (Llama 3.2 1B or 3B for Llama 3.x)"
        )
    loaded, _, _ = load_checkpoint(
        ckpt_dir, *load_args, text_only="A draft model must be a text model, not Llama 3.2 Vision"
    )
    draft, _ = for_runtime(loaded)
    return draft
