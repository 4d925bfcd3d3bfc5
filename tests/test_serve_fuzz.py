"""`llama serve` fuzzed from its own OpenAPI schema with schemathesis: every endpoint's declared body, with values
the schema allows and values it does not, must answer as documented (a declared status, OpenAI's error body for an
error) and never with a server error. Plus the bodies a fuzzer does not make: nested too deeply, not UTF-8."""

import json
import shutil

import pytest
from helpers import TINY_PARAMS, import_or_skip, make_checkpoint

schemathesis = import_or_skip("schemathesis", "pip install -e '.[test]'")
httpx = import_or_skip("httpx", "pip install -e '.[test]'")
import_or_skip("fastapi", "pip install -e '.[serve]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from serve_process import Server  # noqa: E402

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
