"""OpenAI's shapes for the server (`llama.serve.protocol`, `llama.serve.answers`), without a
server or a model: answers read for tool calls, and the text of answers as tokens arrive (stop strings, multi-byte
characters)."""

import asyncio
import json

import pytest
from helpers import import_or_skip

import_or_skip("fastapi", "pip install -e '.[serve]'")

from llama.serve.answers import ChatAnswer  # noqa: E402
from llama.serve.protocol import ChatRequest, tool_calls_out  # noqa: E402
from llama.serve.requests import Output  # noqa: E402
from llama.text import AnswerText  # noqa: E402
from llama.tokenizer import ChatFormat, Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return Tokenizer(tokenizer_path, version="3.1")


def test_an_answer_that_calls_a_tool_reads_as_openai_tool_calls(tokenizer):
    """The reading the server applies to an answer when tools were offered (a random model writes no calls)."""
    formatter = ChatFormat(tokenizer)
    text = '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}'
    (call,) = tool_calls_out(text, "end_of_turn", formatter)
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert tool_calls_out("It is sunny.", "end_of_turn", formatter) is None


def test_stop_strings_are_found_across_tokens_and_never_sent(tokenizer):
    """A stop string split over tokens still cuts the answer, and no part of it is sent before it is known."""
    tokens = [t for text in ["Hello", " wor", "ld", "!", " more"] for t in tokenizer.encode(text, bos=False, eos=False)]
    answer = AnswerText(tokenizer, ["world!"])
    sent = "".join(answer.add(token) for token in tokens[: len(tokens) - 1])
    assert answer.stopped and sent == "Hello "
    plain = AnswerText(tokenizer, ["xyz"])
    assert "".join(plain.add(t) for t in tokens) + plain.flush() == "Hello world! more"


def test_multi_byte_characters_are_sent_whole(tokenizer):
    tokens = tokenizer.encode("naïve 日本語 🎉", bos=False, eos=False)
    answer = AnswerText(tokenizer, [])
    pieces = [answer.add(t) for t in tokens] + [answer.flush()]
    assert "".join(pieces) == "naïve 日本語 🎉" and "\ufffd" not in "".join(pieces)


CALL = '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}}


def answer_of(tokenizer, text: str, stream: bool):
    """The chat answer the server gives, with a tool offered, when the model writes `text` then <|eot_id|>."""
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=stream)

    async def outputs():
        for token in tokenizer.encode(text, bos=False, eos=False):
            yield Output(token=token)
        yield Output(finish="end_of_turn")

    async def run():
        answer = ChatAnswer(ChatFormat(tokenizer), "m", body, prompt=list(range(10)))
        if stream:
            return [chunk async for chunk in answer.stream([outputs()])]
        return await answer.whole([outputs()])

    return asyncio.run(run())


def test_a_tool_call_answers_as_openai_tool_calls(tokenizer):
    choice = answer_of(tokenizer, CALL, stream=False)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_streamed_tool_call_comes_in_one_delta_at_the_end(tokenizer):
    chunks = answer_of(tokenizer, CALL, stream=True)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and not any(d.get("content") for d in deltas)
    (call,) = deltas[-2]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_plain_text_with_tools_offered_is_content(tokenizer):
    choice = answer_of(tokenizer, "It is sunny in Paris.", stream=False)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert choice["finish_reason"] == "stop"
