"""Streaming: chunks join up to the non-streamed result and never split a UTF-8 character."""

import pytest
import torch
from helpers import ScriptedModel

from llama import Llama
from llama.tokenizer import Tokenizer


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.fixture()
def scripted(tokenizer_path):
    def make(text, prompt="Say it:", stop="<|eot_id|>"):
        tokenizer = Tokenizer(tokenizer_path)
        script = tokenizer.encode(text, bos=False, eos=False) + ([tokenizer.special_tokens[stop]] if stop else [])
        model = ScriptedModel(script, tokenizer.n_words)
        model.prompt_len = len(tokenizer.encode(prompt, bos=True, eos=False))
        return Llama(model, tokenizer), script

    return make


@pytest.mark.parametrize("text", ["🦙", "naïve café 🦙🦙 日本語", "plain ascii words"])
def test_chunks_never_split_a_character_and_join_to_the_text(scripted, text):
    generator, script = scripted(text)
    # For the non-ASCII texts, some tokens really do end inside a character.
    pieces = [generator.tokenizer.decode_bytes([t]) for t in script[:-1]]
    assert any(not is_utf8(p) for p in pieces) == (not text.isascii())
    chunks = list(generator.text_completion_stream(["Say it:"], temperature=0, max_gen_len=30))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text
    assert chunks[-1].finished and chunks[-1].stop_reason == "end_of_turn"
    assert chunks[-1].n_tokens == len(script) - 1  # the stop token is not part of the answer
    if not text.isascii():
        assert len(chunks) < len(script)  # partial characters were held back, not sent as pieces
    assert generator.text_completion(["Say it:"], temperature=0, max_gen_len=30)[0]["generation"] == text


def test_length_stop_is_reported(scripted):
    generator, _ = scripted("one two three four five six", stop=None)
    chunks = list(generator.text_completion_stream(["Say it:"], temperature=0, max_gen_len=3))
    assert "".join(c.text for c in chunks) == " ".join("one two three".split())
    assert [c.stop_reason for c in chunks if c.finished] == ["length"]


def test_zero_max_gen_len_still_finishes_every_prompt(scripted):
    generator, _ = scripted("hello")
    chunks = list(generator.text_completion_stream(["Say it:", "Say it:"], temperature=0, max_gen_len=0))
    assert sorted((c.index, c.text, c.finished) for c in chunks) == [(0, "", True), (1, "", True)]


@pytest.mark.slow
def test_streamed_text_equals_text_completion_with_same_seed(tiny_llama):
    prompts = ["The best way to", "日本の首都は", "Once upon a time, in a land"]
    torch.manual_seed(7)
    expected = [r["generation"] for r in tiny_llama.text_completion(prompts, max_gen_len=24)]
    torch.manual_seed(7)
    chunks = list(tiny_llama.text_completion_stream(prompts, max_gen_len=24))
    assert ["".join(c.text for c in chunks if c.index == i) for i in range(3)] == expected
    assert sorted(c.index for c in chunks if c.finished) == [0, 1, 2]
    # Chunks arrive as decoding goes, interleaved across prompts, not one prompt after another.
    first_finished = next(n for n, c in enumerate(chunks) if c.finished)
    assert len({c.index for c in chunks[:first_finished]}) == 3


@pytest.mark.slow
def test_streamed_chat_equals_chat_completion_with_same_seed(tiny_llama):
    dialogs = [
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Où est la gare ?"}],
        [{"role": "user", "content": "Write a haiku about llamas 🦙"}],
    ]
    torch.manual_seed(3)
    expected = tiny_llama.chat_completion(dialogs, max_gen_len=20)
    torch.manual_seed(3)
    chunks = list(tiny_llama.chat_completion_stream(dialogs, max_gen_len=20))
    for i, result in enumerate(expected):
        assert "".join(c.text for c in chunks if c.index == i) == result["generation"]["content"]
        assert [c.stop_reason for c in chunks if c.index == i and c.finished] == [result["stop_reason"]]


def test_stream_rejects_bad_input_like_the_batch_calls(tiny_llama):
    with pytest.raises(ValueError, match="No prompts"):
        list(tiny_llama.text_completion_stream([]))
    with pytest.raises(ValueError, match="top_p"):
        list(tiny_llama.chat_completion_stream([[{"role": "user", "content": "hi"}]], top_p=0))
