"""The server's app in this process over a stub engine, for what it answers before a request reaches an engine
(bad input, /tokenize, /v1/models): no checkpoint, no model, and no engine thread (the client runs no lifespan)."""

from types import SimpleNamespace

from fastapi.testclient import TestClient

from llama.serve.app import Service, create_app
from llama.tokenizer import Tokenizer

MODEL = "stub"
MAX_SEQ_LEN = 4096


class StubEngine:
    """What the routes read of an engine before they submit a request: its vocabulary's size, max_seq_len and
    whether its model takes images. A request that reaches `submit` is answered with a server error (500), which no
    test here expects."""

    def __init__(self, vocab_size: int, takes_images: bool):
        self.model = SimpleNamespace(params=SimpleNamespace(vocab_size=vocab_size))
        self.max_seq_len = MAX_SEQ_LEN
        self.takes_images = takes_images

    def run(self) -> None:  # the Service's thread target; never started here
        pass

    def submit(self, request) -> None:
        raise AssertionError("the request reached the engine")


def stub_client(tokenizer_path: str, takes_images: bool) -> TestClient:
    """An HTTP client of the app over a stub engine, for a model that takes images or one that does not; a server
    error comes back as a 500 answer rather than raised."""
    tokenizer = Tokenizer(tokenizer_path, version="3.1")
    service = Service(StubEngine(tokenizer.n_words, takes_images), tokenizer, MODEL)
    return TestClient(create_app(service), raise_server_exceptions=False)
