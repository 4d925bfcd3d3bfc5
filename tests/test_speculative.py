"""Speculative decoding (`llama.decoding.speculative`, `Llama.build(draft="lookup")`): greedy answers are plain
decoding's token for token, samples are distributed as the model's own, the KV cache's record of each row stays
true after refused guesses, and a text that cannot be guessed costs few extra passes.

The mechanics are checked on a model whose next token is a fixed function of the last one (`CyclingModel`: its
answers repeat, so guesses are kept often and refused where the cycle changes), the answers on the tiny random
checkpoint in float32.
"""

from types import SimpleNamespace

import pytest
import torch

from llama import Llama
from llama.decoding import BatchDecoder
from llama.decoding.speculative import DraftLength, PromptLookup, accept_sampled, nucleus
from llama.runtime.cached_tokens import CachedTokens

VOCAB = 16
STOP = 15


class CyclingModel:
    """A stand-in for `RuntimeTransformer` whose logits at each position favour `successor(token, position)`,
    recording its cache writes as `RuntimeTransformer.forward` does. `successor` cycles 1 -> 2 -> ... -> 7 -> 1,
    except that from position `switch_at` on, 4 goes to 9, then 10, then 1 (a turn no guess from the text so far
    predicts)."""

    def __init__(self, switch_at: int = 10**9):
        self.params = SimpleNamespace(max_seq_len=96, max_batch_size=2, vocab_size=VOCAB)
        self.tok_embeddings = SimpleNamespace(weight=torch.zeros(1))
        self.cached = CachedTokens(2)
        self.calls, self.switch_at, self.rows_run = 0, switch_at, []

    def successor(self, token: int, position: int) -> int:
        if token == 4 and position >= self.switch_at:
            return 9
        return {9: 10, 10: 1}.get(token, token % 7 + 1)

    def forward(self, tokens: torch.Tensor, start_pos: int, last_logits_only: bool = False) -> torch.Tensor:
        self.calls += 1
        self.rows_run.append(tokens.shape[1])
        logits = torch.zeros(*tokens.shape, VOCAB)
        for row, row_tokens in enumerate(tokens.tolist()):
            self.cached.keep(row, start_pos)
            self.cached.wrote(row, start_pos, row_tokens)
            for i, token in enumerate(row_tokens):
                logits[row, i, self.successor(token, start_pos + i)] = 3.0
        return logits[:, -1:] if last_logits_only else logits


def tokenizer(stop_tokens=(STOP,)):
    return SimpleNamespace(pad_id=-1, stop_tokens=set(stop_tokens), special_tokens={})


def decoded(model, prompt, max_gen_len, draft=None, stop_tokens=(STOP,), temperature=0.0):
    decoder = BatchDecoder(model, tokenizer(stop_tokens), prefix_cache=False, draft=draft, draft_max=4)
    tokens, _, reasons = decoder.run([prompt], max_gen_len, temperature, 0.9, logprobs=False, echo=False)
    return tokens[0], reasons[0], decoder.last_drafts


@pytest.mark.parametrize("max_gen_len", [1, 2, 5, 13, 40])
def test_greedy_answers_are_plain_decoding_s_and_take_fewer_passes(max_gen_len):
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    plain_model, speculative_model = CyclingModel(switch_at=15), CyclingModel(switch_at=15)
    plain, plain_reason, _ = decoded(plain_model, prompt, max_gen_len)
    speculative, reason, drafts = decoded(speculative_model, prompt, max_gen_len, draft="lookup")
    assert (speculative, reason) == (plain, plain_reason) and len(plain) == max_gen_len
    if max_gen_len >= 13:
        assert drafts.accepted > 0 and drafts.accepted < drafts.proposed  # kept some guesses, refused others
        assert speculative_model.calls < plain_model.calls


@pytest.mark.parametrize("stop_after", [0, 1, 3, 6])
def test_a_stop_token_among_kept_guesses_ends_the_answer_there(stop_after):
    """A stop token the model agrees with inside a run of guesses ends the answer as plain decoding ends it."""
    prompt = [3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    stop = prompt[-1] % 7 + 1 + stop_after
    stop = (stop - 1) % 7 + 1  # the token `stop_after` steps into the answer
    plain = decoded(CyclingModel(), prompt, 30, stop_tokens=(stop,))
    speculative = decoded(CyclingModel(), prompt, 30, draft="lookup", stop_tokens=(stop,))
    assert speculative[:2] == plain[:2] == (plain[0], "end_of_turn")
    assert len(plain[0]) == stop_after


def test_tiny_model_float32_greedy_answers_are_plain_decoding_s(tiny_llama):
    """The tiny random checkpoint in float32, one prompt at a time and as a batch (which decodes a token a step):
    the same tokens; guesses are made, some kept, some refused."""
    speculative = Llama(tiny_llama.model, tiny_llama.tokenizer, draft="lookup", draft_max=5)
    prompts = ["1, 2, 3, 4, 5, 6", "Hello Hello Hello", "the the the the"]  # answers that repeat a little
    proposed = accepted = 0
    for max_gen_len in (3, 40):
        expected = tiny_llama.text_completion(prompts, temperature=0, max_gen_len=max_gen_len)
        for prompt, plain in zip(prompts, expected):
            got = speculative.text_completion([prompt], temperature=0, max_gen_len=max_gen_len)[0]
            assert got["generation"] == plain["generation"]
            proposed += speculative.last_speed.drafts.proposed
            accepted += speculative.last_speed.drafts.accepted
        batch = speculative.text_completion(prompts, temperature=0, max_gen_len=max_gen_len)
        assert [c["generation"] for c in batch] == [c["generation"] for c in expected]
    assert 0 < accepted < proposed


def test_a_reused_prefix_after_speculation_holds_the_keys_of_its_tokens(tiny_checkpoint, tokenizer_path):
    """With the prefix cache on, the next call reuses what the speculative one left in the cache: its answer is a
    cold model's, so the positions the record claims hold those tokens' keys and values, refused guesses' gone."""
    warm = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=1, device="cpu", prefix_cache=True,
        draft="lookup", draft_max=4,
    )  # fmt: skip
    cold = Llama(warm.model, warm.tokenizer)  # no reuse, no speculation: every call from position 0
    prompt = warm.tokenizer.encode("1, 2, 3, 4, 5, 6", bos=True, eos=False)
    first, _ = warm.generate([prompt], max_gen_len=30, temperature=0)
    assert warm.decoder.last_drafts.proposed > warm.decoder.last_drafts.accepted  # some guesses were refused
    follow_up = prompt + first[0] + warm.tokenizer.encode(" a b c", bos=False, eos=False)
    reused, _ = warm.generate([follow_up], max_gen_len=12, temperature=0)
    assert warm.decoder.last_reused[0] == len(prompt) + len(first[0]) - 1
    expected, _ = cold.generate([follow_up], max_gen_len=12, temperature=0)
    assert reused == expected


def test_after_refused_guesses_the_record_of_the_cache_names_what_it_holds(tiny_llama):
    """After a speculative answer, each position the row's record names holds the keys and values a cold run of
    those tokens gives: refused guesses leave nothing the record does not account for."""
    speculative = Llama(tiny_llama.model, tiny_llama.tokenizer, draft="lookup", draft_max=5)
    prompt = tiny_llama.tokenizer.encode("the the the the", bos=True, eos=False)
    answer, _ = speculative.generate([prompt], max_gen_len=40, temperature=0)
    assert speculative.decoder.last_drafts.proposed > speculative.decoder.last_drafts.accepted
    held = list(tiny_llama.model.cached[0])
    assert held[: len(prompt) + len(answer[0]) - 1] == prompt + answer[0][:-1]
    caches = [layer.attention.kv_cache for layer in tiny_llama.model.layers]
    warm = [(c.cache_k[0, : len(held)].clone(), c.cache_v[0, : len(held)].clone()) for c in caches]
    tiny_llama.model.forward(torch.tensor([held]), 0)  # a cold run of the same tokens, from position 0
    for (keys, values), cache in zip(warm, caches):
        assert torch.allclose(keys, cache.cache_k[0, : len(held)], atol=1e-5)
        assert torch.allclose(values, cache.cache_v[0, : len(held)], atol=1e-5)


def test_a_seeded_speculative_sample_repeats(tiny_llama):
    speculative = Llama(tiny_llama.model, tiny_llama.tokenizer, draft="lookup")
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(speculative.text_completion(["Hello Hello Hello"], temperature=0.7, max_gen_len=30)[0])
    assert runs[0]["generation"] == runs[1]["generation"]


@pytest.mark.parametrize("temperature, top_p, guess", [(1.0, 1.0, 0), (1.0, 1.0, 4), (0.7, 0.8, 1), (0.7, 0.8, 3)])
def test_a_kept_or_refused_guess_leaves_the_model_s_distribution(temperature, top_p, guess):
    """The token `accept_sampled` gives at the guessed position, drawn many times, is distributed as the model's
    own sample there (nucleus at temperature and top_p), whichever token was guessed, in the nucleus or out of it:
    total variation under 0.03 over 20000 draws (the draws' own spread is about 0.008; a rule that may draw a
    refused guess again is 0.16 to 0.25 off where the guess is likely)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    expected = nucleus(logits[:1], temperature, top_p)[0]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(20000):
        accepted, token = accept_sampled(logits, [guess], temperature, top_p, generator)
        counts[guess if accepted else token] += 1
    total_variation = 0.5 * (counts / counts.sum() - expected).abs().sum()
    assert total_variation < 0.03, (counts / counts.sum(), expected)


def test_a_vanishing_temperature_speculates_as_greedy_decoding(tiny_llama):
    """At a temperature so small that the softmax overflows, plain decoding takes the greedy tokens (its limit);
    so does speculative decoding, rather than failing in the draw."""
    speculative = Llama(tiny_llama.model, tiny_llama.tokenizer, draft="lookup")
    prompt = ["1, 2, 3, 4, 5, 6"]
    greedy = tiny_llama.text_completion(prompt, temperature=0, max_gen_len=30)[0]["generation"]
    assert speculative.text_completion(prompt, temperature=1e-300, max_gen_len=30)[0]["generation"] == greedy
    assert speculative.last_speed.drafts.proposed > 0


def test_nucleus_is_the_distribution_sample_top_p_draws_from():
    """`nucleus`, which the acceptance rule reads, keeps the tokens `sample_top_p` can draw, in its proportions."""
    from llama.decoding.sampling import sample_top_p

    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -2.0, 0.5]])
    dist = nucleus(logits, 1.0, 0.75)[0]
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(logits, dim=-1)
    draws = torch.cat([sample_top_p(probs, 0.75, generator) for _ in range(20000)]).reshape(-1)
    counts = torch.bincount(draws, minlength=6).float()
    assert set(torch.nonzero(dist).reshape(-1).tolist()) == set(torch.nonzero(counts).reshape(-1).tolist())
    assert 0.5 * (counts / counts.sum() - dist).abs().sum() < 0.02


def test_guesses_that_always_fail_cost_few_extra_passes():
    """A text the proposer cannot guess: after each refused pass the proposer pauses for longer, so over 400 steps
    fewer than 10% of the passes check a guess (each such pass runs two positions instead of one)."""
    length = DraftLength(draft_max=8)
    checked = 0
    for _ in range(400):
        proposed = length.next()
        if proposed:
            checked += 1
            length.update(proposed, 0)
    assert 0 < checked < 40


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup([5, 6, 7, 8, 5, 6, 9, 1, 5, 6])
    assert lookup.propose(3) == [9, 1, 5]  # the latest earlier "5 6" (a 2-gram: no earlier "1 5 6"), then on
    lookup.extend([9])
    assert lookup.propose(2) == [1, 5]  # "5 6 9" matched as a 3-gram
    assert PromptLookup([1, 2, 3]).propose(4) == []  # 3 never appeared before


@pytest.mark.parametrize("options", [{"draft": "banana"}, {"draft": "lookup", "draft_max": 0}])
def test_a_bad_draft_is_a_clear_error(tiny_llama, options):
    with pytest.raises(ValueError, match="draft"):
        Llama(tiny_llama.model, tiny_llama.tokenizer, **options)


def test_a_draft_quantize_without_a_draft_model_is_refused_before_loading(tmp_path, tokenizer_path):
    for draft in (None, "lookup"):
        with pytest.raises(ValueError, match="draft_quantize quantizes a draft model"):
            Llama.build(str(tmp_path / "not-loaded"), tokenizer_path, draft=draft, draft_quantize="int4")


def test_streamed_speculative_answer_joins_to_the_plain_one(tiny_llama):
    speculative = Llama(tiny_llama.model, tiny_llama.tokenizer, draft="lookup")
    prompt = "1, 2, 3, 4, 5, 6"
    expected = tiny_llama.text_completion([prompt], temperature=0, max_gen_len=40)[0]["generation"]
    chunks = list(speculative.text_completion_stream([prompt], temperature=0, max_gen_len=40))
    assert speculative.decoder.last_drafts.accepted > 0
    assert "".join(chunk.text for chunk in chunks) == expected


@pytest.fixture(scope="module")
def drafted(tiny_checkpoint, tokenizer_path, process_group):
    """The tiny checkpoint with itself as its draft model, and with its int4 copy as the draft."""
    build = dict(max_seq_len=64, max_batch_size=2, device="cpu", draft=str(tiny_checkpoint), draft_max=4)
    return {
        "itself": Llama.build(str(tiny_checkpoint), tokenizer_path, **build),
        "int4": Llama.build(str(tiny_checkpoint), tokenizer_path, draft_quantize="int4", **build),
    }


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["itself", "int4"])
def test_a_draft_model_s_guesses_keep_the_model_s_greedy_answers(drafted, tiny_llama, draft):
    """A draft model (the checkpoint itself, then its int4 copy) proposes its greedy tokens; the answers are plain
    decoding's in float32. The checkpoint as its own draft has nearly every guess kept, several tokens a pass."""
    generator = drafted[draft]
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6", "Once upon a time"]
    for prompt in prompts:
        expected = tiny_llama.text_completion([prompt], temperature=0, max_gen_len=40)[0]["generation"]
        assert generator.text_completion([prompt], temperature=0, max_gen_len=40)[0]["generation"] == expected
        speed = generator.last_speed
        assert speed.drafts.proposed > 0
        if draft == "itself":
            assert speed.acceptance_rate > 0.9 and speed.tokens_per_pass > 2


@pytest.mark.slow
def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoint, tokenizer_path, process_group, tmp_path):
    from helpers import TINY_PARAMS, make_checkpoint

    other = make_checkpoint(tmp_path / "other", {**TINY_PARAMS, "vocab_size": TINY_PARAMS["vocab_size"] + 64})
    with pytest.raises(ValueError, match="vocabulary .* must share the model's tokenizer"):
        Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=64, device="cpu", draft=str(other))


@pytest.mark.slow
def test_llama_complete_speculates_with_the_same_text_and_says_how_it_went(tiny_checkpoint, tokenizer_path):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from helpers import with_repo

    root = Path(__file__).resolve().parents[1]
    flags = [str(tiny_checkpoint), "1, 2, 3, 4, 5, 6", "--tokenizer_path", tokenizer_path, "--device", "cpu"]
    flags += ["--temperature", "0", "--max_gen_len", "40", "--max_seq_len", "64"]

    def complete(*extra):
        command = [sys.executable, "-m", "llama", "complete", *flags, *extra]
        env = dict(os.environ, PYTHONPATH=with_repo(root), OMP_NUM_THREADS="1")
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=root)

    plain, speculative = complete(), complete("--draft", "lookup", "--draft-max", "4")
    assert plain.returncode == speculative.returncode == 0, plain.stderr + speculative.stderr
    assert speculative.stdout == plain.stdout
    assert re.search(r", \d+ of \d+ guessed tokens kept \(\d+%\), \d+\.\d\d tokens a pass\]$", speculative.stderr)
    missing = complete("--draft", str(tiny_checkpoint) + "-nowhere")
    assert missing.returncode == 2 and missing.stderr.startswith("error: The --draft: ") and "lookup" in missing.stderr


def engine_answer(engine, prompt, max_tokens, temperature=0.0, seed=None, top_p=0.9):
    """A request's tokens and finish from `engine`, stepped here until it is done; and the steps that took."""
    from llama.serve.requests import Request

    got = []
    engine.submit(Request(prompt, max_tokens, temperature, top_p, emit=got.append, seed=seed))
    steps = 0
    while engine.load()["running"] or engine.load()["waiting"]:
        engine.step()
        steps += 1
    return [o.token for o in got if o.token is not None], got[-1].finish, steps


def test_the_server_s_engine_speculates_alone_with_plain_greedy_tokens(tiny_llama):
    """A request running alone in the engine decodes speculatively: generate's greedy tokens and finish, in
    fewer steps than tokens, and /health's figures (`Engine.load`) say what was guessed and kept."""
    from llama.serve.engine import Engine

    engine = Engine(tiny_llama.model, tiny_llama.tokenizer, prefix_cache=False, draft="lookup", draft_max=5)
    prompts = ["1, 2, 3, 4, 5, 6", "Hello Hello Hello", "the the the the"]
    steps = tokens = 0
    for text in prompts:
        prompt = tiny_llama.tokenizer.encode(text, bos=True, eos=False)
        for max_tokens in (3, 40):
            expected, reasons = tiny_llama.generate([prompt], max_tokens, temperature=0)
            got, finish, taken = engine_answer(engine, prompt, max_tokens)
            assert got == expected[0]
            assert finish == ("length" if len(got) == max_tokens else "end_of_turn")
            steps, tokens = steps + taken, tokens + len(got)
    assert steps < tokens
    speculation = engine.load()["speculative"]
    assert 0 < speculation["accepted_tokens"] < speculation["proposed_tokens"]
    assert speculation["tokens_per_pass"] > 1 and 0 < speculation["acceptance_rate"] < 1


def test_under_load_the_engine_decodes_every_row_plainly(tiny_llama):
    """While two requests run, no step verifies guesses (a step decodes both rows); each gets its solo greedy
    tokens, and the one left alone speculates."""
    from llama.serve.engine import Engine
    from llama.serve.requests import Request

    engine = Engine(tiny_llama.model, tiny_llama.tokenizer, prefix_cache=False, draft="lookup", draft_max=5)
    prompts = [tiny_llama.tokenizer.encode(text, bos=True, eos=False) for text in ("the the the the", "1, 2, 3, 4")]
    lengths = (40, 12)
    solo = [tiny_llama.generate([p], n, temperature=0)[0][0] for p, n in zip(prompts, lengths)]
    outputs = [[], []]
    for prompt, n, out in zip(prompts, lengths, outputs):
        engine.submit(Request(prompt, n, 0.0, 0.9, emit=out.append))
    passes_with_two = 0
    while engine.load()["running"] or engine.load()["waiting"]:
        two = engine.load()["running"] + engine.load()["waiting"] == 2
        before = engine.speculation.counts.passes
        engine.step()
        passes_with_two += (engine.speculation.counts.passes - before) if two else 0
    assert [[o.token for o in out if o.token is not None] for out in outputs] == solo
    assert passes_with_two == 0 and engine.speculation.counts.passes > 0


def test_a_seeded_request_speculating_in_the_engine_repeats(tiny_llama):
    from llama.serve.engine import Engine

    """The request's generator draws the kept guesses and the tokens after them: the same seed, the same answer
    (at a low temperature and top_p, so that the random model's answers repeat enough to be guessed)."""
    engine = Engine(tiny_llama.model, tiny_llama.tokenizer, draft="lookup", draft_max=5)
    prompt = tiny_llama.tokenizer.encode("the the the the", bos=True, eos=False)
    answers = {}
    for seed in (1, 2, 3, 4, 1, 2, 3, 4):
        got, _, _ = engine_answer(engine, prompt, 30, temperature=0.3, seed=seed, top_p=0.5)
        assert answers.setdefault(seed, got) == got
    assert len(set(map(tuple, answers.values()))) > 1  # the seeds do draw otherwise
    assert engine.speculation.counts.passes > 0


def test_a_draft_model_under_torchrun_s_server_is_refused(monkeypatch, tmp_path):
    from llama.serve.main import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path), "--draft", str(tmp_path)])
    assert parse_args([str(tmp_path), "--draft", "lookup"]).draft == "lookup"


@pytest.mark.slow
def test_llama_serve_speculates_with_plain_answers_and_reports_it_in_health(tiny_checkpoint, tokenizer_path, tmp_path):
    """`llama serve --draft lookup`: a greedy completion is the plain server's, and /health says how speculation
    went."""
    import httpx
    from serve_process import Server

    body = {"model": "tiny", "prompt": "1, 2, 3, 4, 5, 6", "max_tokens": 40, "temperature": 0}
    answers, healths = [], []
    for flags in ([], ["--draft", "lookup", "--draft_max", "5"]):
        flags += ["--tokenizer_path", tokenizer_path, "--max_seq_len", "64", "--model_name", "tiny"]
        server = Server(tiny_checkpoint, tmp_path / f"server{len(answers)}.log", *flags)
        try:
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
            answers.append(answer["choices"][0]["text"])
            healths.append(server.health())
        finally:
            server.stop()
    assert answers[1] == answers[0] and "speculative" not in healths[0]
    speculation = healths[1]["speculative"]
    assert speculation["verification_passes"] > 0 and speculation["accepted_tokens"] > 0
