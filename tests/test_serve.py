"""`python -m llama.serve` as a real process on a tiny checkpoint, driven over loopback by the `openai` client and
by raw HTTP: its answers against `Llama.generate` in this process, streaming, tools, requests that join a running
batch, bad input, a full queue, clients that go away, and shutdown."""

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import List, Literal

import pydantic
import pytest
import torch
from helpers import TINY_PARAMS, import_or_skip, make_checkpoint

httpx = import_or_skip("httpx", "pip install -e '.[test]'")
openai = import_or_skip("openai", "pip install -e '.[test]'")
import_or_skip("fastapi", "pip install -e '.[serve]'")

from serve_process import Server  # noqa: E402

MODEL = "tiny"
KEY = "test-key"
MAX_SEQ_LEN = 1024
ROWS = 4
QUEUE = 2
PREFILL_CHUNK = 16  # small, so that most prompts here are prefilled over several steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_path) -> Path:
    """A tiny Llama 3.1 checkpoint (scaled RoPE: its tokens have the tool-calling roles), tokenizer inside."""
    folder = make_checkpoint(tmp_path_factory.mktemp("serve") / MODEL, dict(TINY_PARAMS, use_scaled_rope=True))
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="module")
def reference(checkpoint, process_group):
    """The same checkpoint in this process, as `Llama.build` loads it, to say what the server must answer. Built
    before the server starts, so that both use the CPU kernels measured here (cached in $XDG_CACHE_HOME)."""
    from llama import Llama

    return Llama.build(str(checkpoint), max_seq_len=MAX_SEQ_LEN, max_batch_size=1, device="cpu")


@pytest.fixture(scope="module")
def server(checkpoint, reference, tmp_path_factory):
    flags = ["--max_batch_size", str(ROWS), "--max_seq_len", str(MAX_SEQ_LEN), "--max_queue", str(QUEUE)]
    flags += ["--prefill_chunk", str(PREFILL_CHUNK), "--api_key", KEY, "--model_name", MODEL]
    running = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", *flags)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body, key: str = KEY) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120)


def solo_tokens(reference, prompt, max_tokens, temperature=0.0, seed=None):
    """What `Llama.generate` gives for this prompt alone (seeded as `Llama.build(seed=seed)` seeds)."""
    if seed is not None:
        torch.manual_seed(seed)
    return reference.generate([prompt], max_tokens, temperature=temperature, top_p=0.9)[0][0]


def chat_prompt(reference, messages):
    return reference.formatter.encode_dialog_prompt(messages)


QUESTIONS = [
    "Hello!",
    "What is the capital of France? Answer in one word, then explain at length.",
    "2+2=?",
    "Write a poem about the sea " * 6,
    "Why?",
]


def test_models_and_health_report_the_model_and_free_rows(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert server.health()["free_rows"] == ROWS


def test_chat_answer_is_llama_generate_s(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[1]}]
    prompt = chat_prompt(reference, messages)
    expected = solo_tokens(reference, prompt, 40)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    assert answer.choices[0].message.content == reference.tokenizer.decode(expected)
    assert answer.choices[0].finish_reason == ("length" if len(expected) == 40 else "stop")
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == 40  # every token sampled, a stop token included
    assert answer.usage.total_tokens == len(prompt) + 40


def test_streamed_chat_joins_to_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=30, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices


@pytest.mark.slow
def test_seeded_sampling_draws_what_a_seeded_build_draws(client, reference):
    prompt_text = QUESTIONS[2]
    expected = solo_tokens(reference, reference.tokenizer.encode(prompt_text, bos=True, eos=False), 25, 0.9, seed=7)
    for _ in range(2):  # and again: the seed is the request's, not the server's
        answer = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=25, temperature=0.9, seed=7)
        assert answer.choices[0].text == reference.tokenizer.decode(expected)


def test_completion_logprobs_and_echo(client, reference):
    prompt = reference.tokenizer.encode(QUESTIONS[0], bos=True, eos=False)
    tokens, logprobs = reference.generate([prompt], 8, temperature=0, logprobs=True)
    answer = client.completions.create(
        model=MODEL, prompt=QUESTIONS[0], max_tokens=8, temperature=0, logprobs=2, echo=True
    )
    choice = answer.choices[0]
    assert choice.text == QUESTIONS[0] + reference.tokenizer.decode(tokens[0])
    # The prompt's tokens (scored: the first one's logprob null) and then the answer's.
    assert choice.logprobs.tokens == [reference.tokenizer.decode([t]) for t in prompt + tokens[0]]
    assert choice.logprobs.token_logprobs[len(prompt) :] == pytest.approx(logprobs[0], abs=1e-4)
    answer_tops = choice.logprobs.top_logprobs[len(prompt) :]
    for top, chosen in zip(answer_tops, choice.logprobs.token_logprobs[len(prompt) :]):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the likeliest
    offsets, text = choice.logprobs.text_offset, choice.text
    for token, offset in list(zip(choice.logprobs.tokens, offsets))[1:]:  # the first, <|begin_of_text|>, not shown
        assert text[offset : offset + len(token)] == token


def test_streamed_chat_logprobs_are_generate_s(client, reference):
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    tokens, logprobs = reference.generate([chat_prompt(reference, messages)], 10, temperature=0, logprobs=True)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True, logprobs=True, top_logprobs=3
    )
    entries = [
        entry
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [entry.token for entry in entries] == [reference.tokenizer.decode([t]) for t in tokens[0]]
    assert [entry.logprob for entry in entries] == pytest.approx(logprobs[0], abs=1e-4)
    assert all(len(entry.top_logprobs) == 3 for entry in entries)


def test_every_prompt_form_is_a_choice_in_request_order(server, reference):
    texts = [QUESTIONS[0], QUESTIONS[2]]
    ids = [reference.tokenizer.encode(text, bos=True, eos=False) for text in texts]
    expected = [reference.tokenizer.decode(solo_tokens(reference, prompt, 6)) for prompt in ids]
    for prompt in (texts[0], texts, ids[0], ids):
        answer = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert [c["index"] for c in choices] == list(range(len(choices)))
        assert [c["text"] for c in choices] == expected[: len(choices)]
        assert answer.json()["usage"]["prompt_tokens"] == sum(len(p) for p in ids[: len(choices)])


def test_a_token_id_outside_the_vocabulary_is_a_400_that_names_it(server):
    answer = post(server, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3, 4, 128256]], "max_tokens": 2})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "prompt[1]" and "prompt[1][2]" in answer.json()["error"]["message"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echoed_logprobs_score_the_prompt_as_the_python_api_does(server, reference, max_tokens):
    """What lm-eval's loglikelihood requests send: token IDs, echo, logprobs; the first token's logprob is null."""
    prompts = [reference.tokenizer.encode(text, bos=True, eos=False) for text in QUESTIONS[:2]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 2}
    answer = post(server, "/v1/completions", body).json()
    for prompt, choice in zip(prompts, answer["choices"]):
        _, expected = reference.generate([prompt], 0, temperature=0, logprobs=True, echo=True)
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected[0][1:], abs=1e-4)
        for chosen, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
            assert len(top) == 2 and max(top.values()) >= chosen - 1e-6
        assert choice["text"].startswith(QUESTIONS[prompts.index(prompt)])  # the text, without <|begin_of_text|>
        assert logprobs["tokens"][0] == "<|begin_of_text|>" and logprobs["text_offset"][:2] == [0, 0]


def test_n_samples_share_one_prompt_and_each_draws_its_own_seed(server, reference):
    """(The samples decode side by side, in a batch, so each is not exactly the solo seeded run: on this random
    model's flat distributions a batched product's rounding moves draws.)"""
    prompt = reference.tokenizer.encode(QUESTIONS[4] + " Tell me.", bos=True, eos=False)
    before = server.health()["reused_prompt_tokens"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 3}
    answer = post(server, "/v1/completions", body).json()
    assert sorted(choice["index"] for choice in answer["choices"]) == [0, 1, 2]
    assert len({choice["text"] for choice in answer["choices"]}) == 3  # seeds 5, 6 and 7
    assert answer["usage"]["prompt_tokens"] == len(prompt) and answer["usage"]["completion_tokens"] == 24
    # The prompt ran once: the two other samples copied all of it but its last token.
    assert server.health()["reused_prompt_tokens"] - before >= 2 * (len(prompt) - 1)
    streamed = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 4, "n": 2, "stream": True})  # fmt: skip
    indexes = {json.loads(line[6:])["choices"][0]["index"] for line in streamed.text.splitlines()
               if line.startswith("data: {")}  # fmt: skip
    assert indexes == {0, 1}


def test_the_tokenizer_endpoints_speak_vllm_s_shapes(server, reference):
    text = "Hello tokenizer"
    tokens = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == reference.tokenizer.encode(text, bos=False, eos=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_SEQ_LEN
    messages = [{"role": "user", "content": text}]
    chat = post(server, "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == chat_prompt(reference, messages)
    assert "".join(chat["token_strs"]) == reference.tokenizer.decode(chat["tokens"])
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    assert post(server, "/detokenize", {"tokens": [5, -1]}).status_code == 400
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


def test_stop_string_cuts_the_answer(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[4]}], max_tokens=30, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = full[10:14]
    cut = client.chat.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index(stop)]


def test_a_conversation_s_next_turns_reuse_the_cache_and_answer_as_generate(server, client, reference):
    """Prefix reuse over HTTP: a second turn, an edited second turn and another conversation, each with the tokens
    and logprobs `Llama.generate` gives the same prompt (in float32), and the reused tokens in `usage` and /health."""
    before = server.health()["reused_prompt_tokens"]
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[1]}]
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)
    second = first + [dict(answer.choices[0].message.to_dict(), role="assistant"), {"role": "user", "content": "Why?"}]
    edited = second[:-1] + [{"role": "user", "content": "How so?"}]
    other = [{"role": "user", "content": QUESTIONS[3]}]
    reused = answer.usage.prompt_tokens_details.cached_tokens
    for messages in (second, edited, other):
        tokens, logprobs = reference.generate([chat_prompt(reference, messages)], 12, temperature=0, logprobs=True)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                             logprobs=True)  # fmt: skip
        assert got.choices[0].message.content == reference.tokenizer.decode(tokens[0])
        assert [entry.logprob for entry in got.choices[0].logprobs.content] == pytest.approx(logprobs[0], abs=1e-4)
        cached = got.usage.prompt_tokens_details.cached_tokens
        if messages is other:  # shares only the start of any chat prompt with what the rows hold
            assert cached < 10
        else:  # the first turn's whole prompt, at least
            assert cached >= len(chat_prompt(reference, first))
        reused += cached
    assert server.health()["reused_prompt_tokens"] - before == reused


@pytest.mark.slow
def test_requests_that_join_a_running_batch_get_their_solo_tokens(server, client, reference):
    """Six requests, started one after another while the others run (two wait for a row), greedy, with prompts
    of 1 to 4 prefill chunks: each gets what it gets alone."""
    jobs = [(QUESTIONS[i % len(QUESTIONS)], 20 + 9 * i) for i in range(6)]
    expected = [solo_tokens(reference, chat_prompt(reference, [{"role": "user", "content": q}]), n) for q, n in jobs]
    answers = [None] * len(jobs)

    def ask(i):
        question, n = jobs[i]
        messages = [{"role": "user", "content": question}]
        if i % 2:
            answers[i] = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)
            answers[i] = answers[i].choices[0].message.content
        else:
            stream = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True
            )
            answers[i] = "".join(c.choices[0].delta.content or "" for c in stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert answers == [reference.tokenizer.decode(t) for t in expected]
    assert server.health()["free_rows"] == ROWS


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Its name"}},
                "required": ["city"],
            },
        },
    }
]


# WEATHER_TOOLS' function in Llama 3.1's JSON tools prompt, written out as Meta's prompt-format document shows
# one (llama-models' llama3_1/prompt_format.md, "JSON based tool calling"): a user message before the question.
WEATHER_TOOL_PROMPT = """\
Answer the user's question by making use of the following functions if needed.
If none of the function can be used, please say so.
Here is a list of functions in JSON format:
{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": [
                {
                    "city": {
                        "type": "object",
                        "description": "Its name"
                    }
                }
            ],
            "required": ["city"]
        }
    }
}

Return function calls in JSON format."""


@pytest.fixture(scope="module")
def meta(tokenizer_path):
    """llama-models' ChatFormat and types: Meta's own prompt writer, on the same tokenizer.model."""
    import_or_skip("llama_models", "pip install -e '.[test]'")
    from llama_models import datatypes
    from llama_models.llama3.chat_format import ChatFormat as MetaChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    return MetaChatFormat(MetaTokenizer(Path(tokenizer_path))), datatypes


def meta_prompt(meta, *messages) -> List[int]:
    """The tokens llama-models writes for a dialog of `RawMessage`s, with the assistant's header after it."""
    chat, types = meta
    return chat.encode_dialog_prompt(list(messages), types.ToolPromptFormat.json).tokens


def assert_prompt_was(server, answer, reference, prompt: List[int], **tokenized) -> None:
    """The server wrote `prompt` for a chat request: /tokenize gives these tokens for its body (`tokenized`), and
    the greedy `answer` the request got has the tokens and logprobs `Llama.generate` gives after them (another
    prompt, even of the same length, gives other logprobs)."""
    assert post(server, "/tokenize", tokenized).json()["tokens"] == prompt
    tokens, logprobs = reference.generate([prompt], answer.usage.completion_tokens, temperature=0, logprobs=True)
    entries = answer.choices[0].logprobs.content
    assert [entry.token for entry in entries] == [reference.tokenizer.decode([token]) for token in tokens[0]]
    assert [entry.logprob for entry in entries] == pytest.approx(logprobs[0], abs=1e-4)
    assert answer.usage.prompt_tokens == len(prompt)


def test_tools_are_offered_in_llama_3_1_s_prompt(server, client, reference, meta):
    """The request's system message becomes the instruction of Llama 3.1's tools system prompt (today's date in
    it), and its tools the JSON tools prompt, in a user message before the question. Content is stripped, as the
    library's ChatFormat strips it (Meta's Llama 3 reference), so no newline ends the system message."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    today = date.today()
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=5, temperature=0, logprobs=True
    )
    assert date.today() == today, "the day changed during the request: run the test again"
    system = f"Environment: ipython\n\nCutting Knowledge Date: December 2023\nToday Date: {today:%d %B %Y}\n\nBe brief."
    _, types = meta
    prompt = meta_prompt(
        meta,
        types.RawMessage(role="system", content=system),
        types.RawMessage(role="user", content=WEATHER_TOOL_PROMPT),
        types.RawMessage(role="user", content="Weather in Paris?"),
    )
    assert_prompt_was(server, answer, reference, prompt, messages=messages, tools=WEATHER_TOOLS)


def test_a_dialog_with_tool_calls_and_results_is_written_as_llama_writes_it(server, client, reference, meta):
    """An assistant message's OpenAI tool call is written as Llama 3.1 writes a JSON call, and a tool's answer
    in an ipython message."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True)
    _, types = meta
    weather = types.ToolCall(call_id="c1", tool_name="get_weather", arguments={"city": "Paris"})
    prompt = meta_prompt(
        meta,
        types.RawMessage(role="user", content="Weather in Paris?"),
        types.RawMessage(role="assistant", content="", tool_calls=[weather]),
        types.RawMessage(role="tool", content="Sunny, 21 C"),
    )
    assert_prompt_was(server, answer, reference, prompt, messages=messages)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "llama"]
    name: str = pydantic.Field(max_length=12)  # a random model ends a string only when it must


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)
    pets: List[Pet] = pydantic.Field(max_length=2)


def test_the_openai_client_s_parse_gets_an_object_that_validates(client):
    """`beta.chat.completions.parse` with a Pydantic model, as applications use it (strict JSON schema), on random
    weights: the grammar makes the answer valid."""
    messages = [{"role": "user", "content": "Describe a person."}]
    for temperature in (0.0, 1.0):
        answer = client.beta.chat.completions.parse(
            model=MODEL, messages=messages, response_format=Person, max_tokens=120, temperature=temperature
        )
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(answer.choices[0].message.parsed, Person)
        assert Person.model_validate_json(answer.choices[0].message.content) == answer.choices[0].message.parsed


def test_a_named_tool_choice_calls_that_function_with_valid_arguments(client):
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
            "additionalProperties": False}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": city}},
        {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": city}},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=tools, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_json_object_completions_and_a_schema_that_cannot_compile(server):
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 40, "response_format": {"type": "json_object"}}
    answer = post(server, "/v1/completions", body).json()
    assert answer["choices"][0]["text"].startswith("{")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "when": {"type": "string", "pattern": "(("}}}}}  # fmt: skip
    answer = post(server, "/v1/chat/completions", {**GOOD, "response_format": bad})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "response_format"
    assert "unclosed group" in answer.json()["error"]["message"]


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
BAD = {
    "malformed JSON": ('{"model": "tiny", "messages": [', None),
    "not an object": ("[1, 2]", None),
    "unknown field": ({**GOOD, "frequency_boost": 2}, "frequency_boost"),
    "bad role": ({**GOOD, "messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
    "no messages": ({**GOOD, "messages": []}, "messages"),
    "prompt longer than the window": (
        {**GOOD, "messages": [{"role": "user", "content": "word " * 2000}]},
        "messages",
    ),
    "max_tokens over the limit": ({**GOOD, "max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    "max_tokens zero": ({**GOOD, "max_tokens": 0}, "max_tokens"),
    "negative temperature": ({**GOOD, "temperature": -1}, "temperature"),
    "top_p over 1": ({**GOOD, "top_p": 1.5}, "top_p"),
    "more choices than n allows": ({**GOOD, "n": 9}, "n"),
    "empty stop string": ({**GOOD, "stop": [""]}, "stop"),
    "content of a wrong type": ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_with_an_openai_error_and_the_server_goes_on(server, case):
    body, param = BAD[case]
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and (param is None or error["param"].startswith(param))
    assert post(server, "/v1/chat/completions", GOOD).status_code == 200


def test_a_body_over_the_limit_is_refused(server):
    response = post(server, "/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * (17 * 2**20) + b'"}')
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_unknown_model_is_a_404(server):
    response = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_the_api_key_is_checked(server):
    assert post(server, "/v1/chat/completions", GOOD, key="wrong").status_code == 401
    no_key = httpx.post(server.url + "/v1/chat/completions", json=GOOD, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"


def wait_for(condition, what: str, seconds: float = 30):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_full_queue_is_a_429_and_clients_that_leave_free_their_rows(server):
    """Rows and queue filled with long streams; one more request is refused; the clients hang up mid-stream and
    their rows come free at once, long before their answers could have ended."""
    long = {**GOOD, "max_tokens": MAX_SEQ_LEN - 20, "stream": True, "temperature": 0}
    before = server.health()["sampled_tokens"]
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as http:
        streams = [
            http.stream("POST", server.url + "/v1/chat/completions", json=long, headers=headers)
            for _ in range(ROWS + QUEUE)
        ]
        responses = [stream.__enter__() for stream in streams]
        wait_for(lambda: server.health()["waiting"] == QUEUE and server.health()["running"] == ROWS, "a full queue")
        refused = post(server, "/v1/chat/completions", GOOD)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        for response in responses[:ROWS]:  # the running ones have sent a token: read one
            next(line for line in response.iter_lines() if '"content": "' in line and '"content": ""' not in line)
        for stream in streams:
            stream.__exit__(None, None, None)
    wait_for(lambda: server.health()["free_rows"] == ROWS and server.health()["waiting"] == 0, "free rows")
    sampled = server.health()["sampled_tokens"]
    time.sleep(0.5)
    assert server.health()["sampled_tokens"] == sampled  # nothing runs on for the clients gone
    assert sampled - before < ROWS * long["max_tokens"]  # and their answers were cut short
    assert post(server, "/v1/chat/completions", GOOD).status_code == 200


@pytest.mark.slow
def test_a_client_that_gives_up_on_a_whole_answer_frees_its_row(server):
    before = server.health()["sampled_tokens"]
    body = {**GOOD, "max_tokens": MAX_SEQ_LEN - 20, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(30, read=0.3),
        )
    wait_for(lambda: server.health()["free_rows"] == ROWS, "free rows")
    assert server.health()["sampled_tokens"] - before < body["max_tokens"]  # stopped before the end


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_the_requests_in_flight_and_exits(checkpoint, reference, tmp_path, sig):
    running = Server(checkpoint, tmp_path / "server.log", "--max_seq_len", "256", "--model_name", MODEL)
    answers = []

    def ask():
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
        answers.append(httpx.post(running.url + "/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=ask)
    thread.start()
    wait_for(lambda: running.health()["running"] == 1, "the request to run")
    running.process.send_signal(sig)
    try:
        assert running.process.wait(timeout=60) in (-sig, 128 + sig)  # the status of an end by that signal
    finally:
        running.stop()
    thread.join()
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 200


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_two_processes_serve_one_process_s_tokens(checkpoint, client, reference, tmp_path):
    """A 2-shard copy of the checkpoint under `torchrun --nproc_per_node 2`: rank 0 serves and plans, both run
    the model; concurrent requests get the greedy tokens of the one-process server."""
    sharded = make_checkpoint(tmp_path / MODEL, dict(TINY_PARAMS, use_scaled_rope=True), n_shards=2)
    shutil.copy(checkpoint / "tokenizer.model", sharded / "tokenizer.model")
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m")
    running = Server(sharded, tmp_path / "server.log", "--max_seq_len", "256", "--api_key", KEY, launcher=launcher)
    questions = QUESTIONS[:3]
    answers = {}

    def ask(two_processes, question):
        messages = [{"role": "user", "content": question}]
        answer = two_processes.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        answers[question] = answer.choices[0].message.content

    try:
        two_processes = openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        threads = [threading.Thread(target=ask, args=(two_processes, q)) for q in questions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        running.process.send_signal(signal.SIGTERM)
        running.process.wait(timeout=60)
    finally:
        running.stop()
    for question in questions:
        messages = [{"role": "user", "content": question}]
        one_process = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        assert answers[question] == one_process.choices[0].message.content


@pytest.mark.slow
def test_without_fastapi_it_says_what_to_install():
    code = "import sys; sys.modules['fastapi'] = None; from llama.serve import main; main(['--ckpt_dir', 'x'])"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert result.returncode == 2
    assert "pip install 'llama3[serve]'" in result.stderr
