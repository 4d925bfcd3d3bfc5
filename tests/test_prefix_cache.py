"""Prefix reuse: a prompt whose start a KV-cache row already holds runs only the rest, and gets (in float32) the
tokens and logprobs of the same prompt run cold, through `Llama`'s calls and through the engine's rows. Over HTTP:
tests/test_serve.py."""

from types import SimpleNamespace
from typing import List

import pytest
import torch
from helpers import TINY_PARAMS

from llama import Llama
from llama.checkpoint import random_weights, write_meta_checkpoint
from llama.runtime.cached_tokens import CachedTokens, common_prefix_length
from llama.serve.engine import Engine
from llama.serve.requests import Output, Request

MAX_GEN = 10
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly."}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint whose output layer is scaled up: its next-token distributions have clear winners, as a
    trained model's mostly do, so that a seeded draw picks the same token whatever the float32 rounding of its
    logits (the plain random model's are so flat that one part in a million can move a draw)."""
    weights = random_weights(TINY_PARAMS, seed=5)
    weights["output.weight"] = weights["output.weight"] * 8
    folder = tmp_path_factory.mktemp("prefix") / "peaked"
    write_meta_checkpoint(folder, TINY_PARAMS, weights)
    return folder


@pytest.fixture(scope="module")
def warm(checkpoint, tokenizer_path, process_group):
    return Llama.build(
        str(checkpoint), tokenizer_path, max_seq_len=256, max_batch_size=2, device="cpu", prefix_cache=True
    )


@pytest.fixture(scope="module")
def cold(checkpoint, tokenizer_path, process_group):
    return Llama.build(
        str(checkpoint), tokenizer_path, max_seq_len=256, max_batch_size=2, device="cpu", prefix_cache=False
    )


def chat(generator: Llama, dialogs, temperature: float):
    torch.manual_seed(7)
    return generator.chat_completion(dialogs, temperature=temperature, max_gen_len=MAX_GEN, logprobs=True)


def assert_same_answers(got, expected):
    for g, e in zip(got, expected):
        assert g["tokens"] == e["tokens"]
        assert g["logprobs"] == pytest.approx(e["logprobs"], abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_chat_s_next_turn_reuses_the_dialog_and_answers_as_cold(warm, cold, temperature):
    dialog = [SYSTEM, {"role": "user", "content": "Tell me about llamas."}]
    first = chat(warm, [dialog], temperature)[0]
    assert_same_answers([first], chat(cold, [dialog], temperature))
    dialog += [first["generation"], {"role": "user", "content": "And alpacas?"}]
    got = chat(warm, [dialog], temperature)
    first_prompt = warm.formatter.encode_dialog_prompt(dialog[:2])
    assert warm.decoder.last_reused[0] >= len(first_prompt)  # the whole first turn's prompt, at least
    assert cold.decoder.last_reused == [0]
    assert_same_answers(got, chat(cold, [dialog], temperature))


def test_an_edited_last_message_reuses_the_dialog_before_it(warm, cold):
    dialog = [SYSTEM, {"role": "user", "content": "Name three animals."}]
    chat(warm, [dialog], 0.0)
    edited = [SYSTEM, {"role": "user", "content": "Name three plants."}]
    got = chat(warm, [edited], 0.8)
    encode = warm.formatter.encode_dialog_prompt
    assert warm.decoder.last_reused[0] == common_prefix_length(encode(dialog), encode(edited))  # up to "animals"
    assert_same_answers(got, chat(cold, [edited], 0.8))


def test_each_row_of_a_batch_reuses_its_own_prompt(warm, cold):
    prompts = ["The capital of France is", "Once upon a time, in a land far away,"]
    first = warm.text_completion(prompts, temperature=0, max_gen_len=MAX_GEN)
    longer = [p + r["generation"] + " and then" for p, r in zip(prompts, first)]
    torch.manual_seed(3)
    got = warm.text_completion(longer, temperature=0.8, max_gen_len=MAX_GEN, logprobs=True)
    assert warm.decoder.last_reused[0] >= len(warm.tokenizer.encode(prompts[0], bos=True, eos=False))
    torch.manual_seed(3)
    assert_same_answers(got, cold.text_completion(longer, temperature=0.8, max_gen_len=MAX_GEN, logprobs=True))


def test_a_streamed_answer_reuses_the_cache_and_joins_to_the_cold_answer(warm, cold):
    dialog = [SYSTEM, {"role": "user", "content": "Count to five."}]
    chat(warm, [dialog], 0.0)
    dialog += [{"role": "assistant", "content": "One, two."}, {"role": "user", "content": "Go on."}]
    torch.manual_seed(7)
    text = "".join(c.text for c in warm.chat_completion_stream([dialog], temperature=0.8, max_gen_len=MAX_GEN))
    assert warm.decoder.last_reused[0] > len(SYSTEM["content"]) // 8  # the system message, at least
    assert text == chat(cold, [dialog], 0.8)[0]["generation"]["content"]


def test_a_failed_step_leaves_no_claim_on_the_rows_it_was_writing(warm, monkeypatch):
    prompt = warm.tokenizer.encode("A prompt that will be cut short by a fault", bos=True, eos=False)
    warm.generate([prompt], 4, temperature=0)
    assert warm.model.cached[0][: len(prompt)] == prompt

    def fail(*args, **kwargs):
        raise RuntimeError("a fault inside the model")

    monkeypatch.setattr(warm.model.layers[1], "forward", fail)
    with pytest.raises(RuntimeError, match="a fault"):
        warm.generate([prompt[:5] + [1000, 1001]], 4, temperature=0)
    assert warm.model.cached[0] == prompt[:5]  # what the failed call would have overwritten is no longer claimed


# The engine ---------------------------------------------------------------------------------------------------


def serve(engine: Engine, prompts: List[List[int]], seeds=None, temperature=0.0) -> List[List[Output]]:
    """Submit every prompt at once and step the engine until all are done; each request's outputs."""
    outputs = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        seed = None if seeds is None else seeds[i]
        engine.submit(Request(prompt, MAX_GEN, temperature, 0.9, emit=outputs[i].append, seed=seed, top_logprobs=0))
    while engine.load()["running"] or engine.load()["waiting"]:
        engine.step()
    return outputs


def tokens_of(outputs: List[Output]) -> List[int]:
    return [o.token for o in outputs if o.token is not None]


def cold_tokens(cold: Llama, prompt: List[int], temperature=0.0, seed=None) -> List[int]:
    if seed is not None:
        torch.manual_seed(seed)
    return cold.generate([prompt], MAX_GEN, temperature=temperature, top_p=0.9)[0][0]


def test_each_conversation_s_next_turn_finds_its_own_row_and_a_new_one_takes_the_oldest(warm, cold):
    engine = Engine(warm.model, warm.tokenizer)
    warm.model.cached.forget()
    encode = warm.formatter.encode_dialog_prompt
    dialogs = {name: [SYSTEM, {"role": "user", "content": f"Hello, I am {name}."}] for name in ("Ann", "Bob")}
    rows = {}
    for turn in range(2):
        for name, dialog in dialogs.items():
            prompt = encode(dialog)
            (outputs,) = serve(engine, [prompt], seeds=[turn], temperature=0.8)
            assert tokens_of(outputs) == cold_tokens(cold, prompt, 0.8, seed=turn)
            row = next(i for i in range(2) if warm.model.cached[i][: len(prompt)] == prompt)
            if turn == 0:
                rows[name] = row
            else:  # its own row, which held the whole dialog but the new message
                assert row == rows[name]
                assert outputs[-1].cached_tokens >= len(encode(dialog[:2]))
            answer = warm.tokenizer.decode(tokens_of(outputs))
            dialog += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me more."}]
    assert rows["Ann"] != rows["Bob"]
    # A third conversation takes the row used least recently (Ann's), and still answers as cold.
    prompt = encode([SYSTEM, {"role": "user", "content": "I am Cy."}])
    (outputs,) = serve(engine, [prompt])
    assert warm.model.cached[rows["Ann"]][: len(prompt)] == prompt
    assert tokens_of(outputs) == cold_tokens(cold, prompt)
    # Ann comes back: her row now holds Cy's dialog, of which she shares the system message only.
    prompt = encode(dialogs["Ann"])
    (outputs,) = serve(engine, [prompt])
    assert len(encode([SYSTEM])) - 5 <= outputs[-1].cached_tokens < len(encode(dialogs["Ann"][:2]))
    assert tokens_of(outputs) == cold_tokens(cold, prompt)


def test_requests_that_share_a_context_run_it_once_and_answer_as_cold(warm, cold):
    context = "Answer each question in one word. " * 8
    prompts = [warm.tokenizer.encode(context + q, bos=True, eos=False) for q in ("Why?", "Where?", "When?")]
    shared = len(warm.tokenizer.encode(context, bos=True, eos=False)) - 1
    warm.model.cached.forget()
    engine = Engine(warm.model, warm.tokenizer, prefill_chunk=16)
    before = engine.load()["reused_prompt_tokens"]
    outputs = serve(engine, prompts)  # three requests, two rows: the third waits for a row
    for prompt, out in zip(prompts, outputs):
        assert tokens_of(out) == cold_tokens(cold, prompt)
    cached = [out[-1].cached_tokens for out in outputs]
    assert cached[0] == 0 and all(c >= shared for c in cached[1:])  # the second copied it, the third found it
    assert engine.load()["reused_prompt_tokens"] - before == sum(cached)


def test_without_prefix_cache_the_engine_runs_every_prompt_whole(warm, cold):
    prompt = warm.tokenizer.encode("The same prompt twice", bos=True, eos=False)
    engine = Engine(warm.model, warm.tokenizer, prefix_cache=False)
    for _ in range(2):
        (outputs,) = serve(engine, [prompt])
        assert outputs[-1].cached_tokens == 0
        assert tokens_of(outputs) == cold_tokens(cold, prompt)
    assert engine.load()["reused_prompt_tokens"] == 0


def test_a_row_being_copied_into_is_no_source_for_the_tokens_it_loses():
    """Row 0 holds an old dialog (S + A) and row 1 another (S + B + x). Request B' continues row 1's dialog but lands
    in row 0 (the least recently used), so this step copies S + B's tail from row 1 over A. Request A', which
    continues A, must not copy A from row 0 in the same step: it would get B's keys and values."""
    model = SimpleNamespace(
        params=SimpleNamespace(max_batch_size=3, max_seq_len=64),
        cached=CachedTokens(3),
        tok_embeddings=SimpleNamespace(weight=torch.zeros(1)),
    )
    system, a, b = list(range(1, 11)), list(range(20, 26)), list(range(30, 36))
    model.cached.wrote(0, 0, system + a)
    model.cached.wrote(1, 0, system + b + [99])
    model.cached.wrote(2, 0, [7, 7, 7])
    engine = Engine(model, SimpleNamespace(stop_tokens=set()))
    engine.last_used = [1, 2, 3]
    for prompt in (system + b + [40], system + a + [50]):
        engine.submit(Request(prompt, 4, 0.0, 0.9, emit=lambda output: None))
    engine.admit()
    assert [row.request.prompt[-1] for row in engine.rows[:2]] == [40, 50]  # B' in row 0, A' in row 1
    plan = engine.plan()
    assert plan.copies == [(1, 0, 10, 16)]  # S + B from row 1 into row 0; nothing from row 0 for A'
    assert engine.rows[1].prefilled == 10
