"""`llama serve` fuzzed from its own OpenAPI schema with schemathesis: every endpoint's declared body, with values
the schema allows and values it does not, must answer as documented (a declared status, OpenAI's error body for an
error) and never with a server error. Plus the bodies a fuzzer does not make: nested too deeply, not UTF-8; and
image parts whose URL is any text or whose data is any bytes (hypothesis), on a text model's server and on a vision
model's (in this process, over a stub engine)."""

import base64
import json
import shutil
import time

import pytest
from helpers import TINY_PARAMS, import_or_skip, make_checkpoint, png_bytes

schemathesis = import_or_skip("schemathesis", "pip install -e '.[test]'")
httpx = import_or_skip("httpx", "pip install -e '.[test]'")
import_or_skip("fastapi", "pip install -e '.[serve]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serve_process import Server  # noqa: E402
from serve_stub import MODEL, stub_client  # noqa: E402

from llama.serve.protocol import ErrorBody  # noqa: E402

KEY = "fuzz-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_path):
    """A small server: short answers (max_seq_len 48) keep each fuzzed request quick."""
    folder = make_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny", TINY_PARAMS)
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    flags = ["--max_seq_len", "48", "--max_batch_size", "2", "--max_queue", "8", "--api_key", KEY]
    flags += ["--model_name", "tiny"]
    running = Server(folder, tmp_path_factory.mktemp("log") / "server.log", *flags)
    yield running
    running.stop()


@pytest.mark.slow
def test_every_answer_is_as_documented(server):
    """Each operation of the schema, fuzzed on its own (schemathesis' pytest plugin does not run under this pytest)."""
    api = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 7

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def answers_as_documented(case):
            # Left out: that every request the schema allows is accepted. A prompt's room in max_seq_len depends on
            # its token count, which no schema can state (such requests get a documented 400).
            excluded = [schemathesis.checks.positive_data_acceptance]
            case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, excluded_checks=excluded)

        answers_as_documented()


def post(server, path: str, content: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("body", [b"[" * 400_000 + b"]" * 400_000, b'{"model": "\xff\xfe"}', b"{" * 100_000])
def test_a_body_that_cannot_be_read_is_a_400_in_openai_s_shape(server, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        answer = post(server, path, body)
        assert answer.status_code == 400, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200  # and the server goes on
    assert "Traceback" not in server.log.read_text()


def test_the_schema_declares_each_body_and_its_errors(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for path, model in [("/v1/chat/completions", "ChatRequest"), ("/v1/completions", "CompletionRequest")]:
        operation = paths[path]["post"]
        body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body_schema == {"$ref": f"#/components/schemas/{model}"}
        assert {"400", "401", "404", "413", "429"} <= set(operation["responses"])
    for path in ("/tokenize", "/detokenize"):
        assert "requestBody" in paths[path]["post"]
    assert json.dumps(paths).count("ErrorBody") >= 10


# Image parts --------------------------------------------------------------------------------------------------

ANSWER_S = 5  # the most seconds one image part may take to be read or refused, however hostile its URL
URL_STARTS = ["data:", "data:image/png;base64,", "DATA:;BASE64,", "data:,", "data:;base64", "http://", "https://", ""]
# Any text, after nothing or the start of a URL the server might take; or a short piece repeated up to a megabyte or
# so (where a parser that backtracks would take far longer than linear time).
urls = st.one_of(
    st.builds(str.__add__, st.sampled_from(URL_STARTS), st.text()),
    st.builds(
        lambda start, piece, times: start + piece * times,
        st.sampled_from(URL_STARTS),
        st.text(min_size=1, max_size=8),
        st.integers(0, 200_000),
    ),
)
# Any bytes; or a real image file cut short, or with bytes changed, or with bytes after it.
IMAGE_FILES = [png_bytes(17, 9), png_bytes(3, 40, mode="L")]
damaged_images = st.builds(
    lambda file, cut, at, noise: file[:cut] + noise + file[cut + at :],
    st.sampled_from(IMAGE_FILES),
    st.integers(0, max(map(len, IMAGE_FILES))),
    st.integers(0, 16),
    st.binary(max_size=16),
)
payloads = st.one_of(st.binary(), damaged_images, st.sampled_from(IMAGE_FILES))


@pytest.fixture(scope="module")
def vision_client(tokenizer_path):
    return stub_client(tokenizer_path, takes_images=True)


def image_message(url: str) -> list:
    image = {"type": "image_url", "image_url": {"url": url}}
    return [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]


def assert_refused_naming(answer: httpx.Response, param: str) -> None:
    assert answer.status_code == 400, answer.text
    error = ErrorBody.model_validate(answer.json()).error
    assert error.param == param and error.type == "invalid_request_error"


def assert_read_or_refused(client, url: str) -> None:
    """The vision server's /tokenize answers a user message with an image part at `url` within `ANSWER_S`: a 200
    whose tokens hold its one <|image|>, or a 400 in OpenAI's shape that names the part."""
    start = time.monotonic()
    body = {"model": MODEL, "messages": image_message(url), "return_token_strs": True}
    answer = client.post("/tokenize", json=body)
    assert time.monotonic() - start < ANSWER_S
    if answer.status_code == 200:
        assert answer.json()["token_strs"].count("<|image|>") == 1
    else:
        assert_refused_naming(answer, "messages[0].content[1].image_url.url")


@given(url=urls)
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_any_image_url_is_read_or_refused_naming_the_part(vision_client, url):
    assert_read_or_refused(vision_client, url)


@given(payload=payloads, media_type=st.sampled_from(["image/png", "image/jpeg", "", "text/plain"]))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_any_base64_payload_is_read_or_refused_naming_the_part(vision_client, payload, media_type):
    assert_read_or_refused(vision_client, f"data:{media_type};base64,{base64.b64encode(payload).decode()}")


def test_a_whole_image_file_is_read_and_half_of_one_refused(vision_client):
    """Both outcomes the properties above allow do happen: they are not vacuous."""
    for file in IMAGE_FILES:
        for payload, status in [(file, 200), (file[: len(file) // 2], 400)]:
            url = "data:image/png;base64," + base64.b64encode(payload).decode()
            answer = vision_client.post("/tokenize", json={"messages": image_message(url)})
            assert answer.status_code == status, answer.text


@given(url=urls)
@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_a_text_model_s_server_refuses_any_image_part_naming_it(server, url):
    body = {"model": "tiny", "messages": image_message(url[:1000]), "max_tokens": 1}
    assert_refused_naming(post(server, "/v1/chat/completions", json.dumps(body).encode()), "messages[0].content[1]")
