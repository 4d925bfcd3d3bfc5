"""Where a checkpoint named the way people already name it lies: a model of ollama's local store
(`ollama:llama3.2:1b`), or a folder that holds one GGUF file (a Hugging Face cache snapshot of a GGUF repository).

ollama keeps each model as a manifest (`manifests/<registry>/<namespace>/<name>/<tag>`, JSON) whose layer of media
type `application/vnd.ollama.image.model` names the GGUF blob by its digest (`blobs/sha256-<hex>`), under
$OLLAMA_MODELS, else ~/.ollama/models.
"""

import json
import os
import re
from pathlib import Path
from typing import List

from llama.checkpoint.params import HF_CONFIG, META_PARAMS

OLLAMA_PREFIX = "ollama:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # each part of a model's name, and its tag


def is_ollama_name(ckpt_dir) -> bool:
    return isinstance(ckpt_dir, str) and ckpt_dir.startswith(OLLAMA_PREFIX)


def ollama_store() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def ollama_blob(name: str) -> Path:
    """The GGUF blob of the ollama model `name` ("llama3.2", "llama3.2:1b", "user/model:tag",
    "host/namespace/model:tag"; the tag "latest" where none is given) in ollama's local store.

    Raises:
        ValueError: for a name of another form, or a manifest without a model layer.
        FileNotFoundError: naming the store, where the model or its blob is not there.
    """
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if not 1 <= len(parts) <= 3 or not all(OLLAMA_NAME.fullmatch(p) for p in [*parts, tag or "latest"]):
        raise ValueError(f"{OLLAMA_PREFIX}{name} is not an ollama model name; write it as ollama:NAME[:TAG]")
    parts = [OLLAMA_REGISTRY, "library"][: 3 - len(parts)] + parts
    store = ollama_store()
    manifest = store.joinpath("manifests", *parts, tag or "latest")
    if not manifest.is_file():
        raise FileNotFoundError(
            f"ollama has no model {name} in {store} (no {manifest}); run `ollama pull {name}`, or set OLLAMA_MODELS "
            "to the store that holds it"
        )
    try:
        layers = json.loads(manifest.read_text()).get("layers", [])
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (ValueError, TypeError, AttributeError, KeyError, StopIteration):
        raise ValueError(f"{manifest} names no model layer ({OLLAMA_MODEL_LAYER}); is it an ollama manifest?") from None
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ValueError(f"{manifest}: the model layer's digest {digest!r} is not sha256:<64 hex digits>")
    blob = store / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise FileNotFoundError(f"ollama's manifest {manifest} names {blob}, which is missing; `ollama pull {name}`")
    return blob


def gguf_files_in(folder: Path) -> List[Path]:
    """The GGUF files of a folder, or of its Hugging Face cache snapshots (`snapshots/<revision>/`)."""
    return sorted(folder.glob("*.gguf")) or sorted(folder.glob("snapshots/*/*.gguf"))


def checkpoint_path(ckpt_dir) -> Path:
    """`ckpt_dir` as the path of a checkpoint folder or file: an ollama name's blob, a folder's one GGUF file (where
    it has no params.json or config.json), or the path itself.

    Raises:
        ValueError: for a folder that holds several GGUF files (naming them).
    """
    if is_ollama_name(ckpt_dir):
        return ollama_blob(ckpt_dir[len(OLLAMA_PREFIX) :])
    path = Path(ckpt_dir)
    if path.is_dir() and not (path / META_PARAMS).is_file() and not (path / HF_CONFIG).is_file():
        found = gguf_files_in(path)
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(str(p.relative_to(path)) for p in found[:8])
            raise ValueError(f"{path} holds several GGUF files ({names}); pass the one to load")
    return path
