"""Reading a file that may be local or at a blobfile URL (`gs://...`, `az://...`), as Meta's reference code reads
tokenizer.model through `blobfile` (and the checkpoint's params.json, read here the same way).

Local paths are read with Python's own functions; `blobfile` is imported only for a URL. Importing it (and urllib3
with it) takes about a quarter of a second, which every command would otherwise pay at start.
"""

import importlib
import os


def is_url(path: str) -> bool:
    return "://" in path


def blobfile():
    return importlib.import_module("blobfile")


def exists(path: str) -> bool:
    return blobfile().exists(path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return blobfile().isdir(path) if is_url(path) else os.path.isdir(path)


def join(folder: str, name: str) -> str:
    return blobfile().join(folder, name) if is_url(folder) else os.path.join(folder, name)


def read_bytes(path: str) -> bytes:
    if is_url(path):
        return blobfile().read_bytes(path)
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    if is_url(path):
        return blobfile().read_text(path)
    with open(path, encoding="utf-8") as f:
        return f.read()
