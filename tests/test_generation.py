"""Generation checked against independent, deliberately simple re-implementations written here.

The reference loop decodes a padded batch with a KV cache. The checks below instead re-run each prompt alone
through `Transformer.forward(tokens, 0)` on the whole sequence so far (a full forward from position 0 rewrites
the KV cache it reads, so it depends on nothing left over from earlier calls), then take the last position's
argmax, softmax or log-softmax. Agreement shows that padding, the start at the shortest prompt, the
"keep prompt tokens" rule, the KV cache, stop tokens and the output cuts leave each sequence what it would be
decoded alone, as in Meta's reference `Llama.generate`.
"""

import copy
import functools
import math
from typing import List, Tuple

import pytest
import torch

from llama import Llama
from llama.decoding.sampling import greedy_pick, sample_top_p

BOS, EOS, START_HEADER, END_HEADER, EOT = 128000, 128001, 128006, 128007, 128009

TEXTS = [
    "Hello",
    "The capital of France is",
    "The best part of a long walk is",
]

# A dialog whose content has surrounding whitespace, which the chat format strips.
DIALOG = [
    {"role": "system", "content": "Answer briefly. "},
    {"role": "user", "content": "  What is the capital of France?\n"},
]


# Independent implementations ------------------------------------------------------------------------------
#
# The model is causal: a full forward's logits at position t depend only on seq[:t + 1]. So one forward over
# prompt + candidate output gives, at every step, exactly the logits that a token-by-token loop re-running the
# whole prefix would see; each step's choice can then be re-made from them and compared with the candidate.
# `greedy_alone` is that loop written out, used where the tokens are not known in advance.


def full_logits(model, seq: List[int]) -> torch.Tensor:
    """Logits for every position of `seq`, from one forward pass over the whole sequence: (len, vocab)."""
    return _full_logits(model, tuple(seq))


@functools.lru_cache(maxsize=8)  # several checks often score the same sequence; CPU time in CI is short
def _full_logits(model, seq: Tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward(torch.tensor([seq]), 0)[0].float()


def greedy_alone(model, prompt: List[int], n: int) -> List[int]:
    """The `n` tokens greedy decoding appends to `prompt`, decoded alone: a full forward per step, no cache."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt) :]


def greedy_picks(model, prompt: List[int], generated: List[int]) -> List[int]:
    """What greedy decoding of `prompt` alone picks after prompt + generated[:i], for i = 0..len(generated)."""
    logits = full_logits(model, prompt + generated)
    return logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


def assert_greedy(model, prompt: List[int], generated: List[int], n: int, stop_tokens=frozenset()) -> None:
    """`generated` is greedy decoding of `prompt` alone: `n` tokens, or fewer when the next pick is a stop token
    (which the output leaves out)."""
    picks = greedy_picks(model, prompt, generated)
    assert generated == picks[:-1]
    assert not set(generated) & set(stop_tokens)
    if len(generated) < n:
        assert picks[-1] in stop_tokens, f"stopped after {len(generated)} of {n} tokens without a stop token"
    else:
        assert len(generated) == n


def logprobs_alone(model, seq: List[int]) -> List[float]:
    """log p(seq[t] | seq[:t]) for every t, with 0 for position 0 (nothing to condition on)."""
    logp = torch.log_softmax(full_logits(model, seq), dim=-1)
    return [0.0] + [logp[t - 1, seq[t]].item() for t in range(1, len(seq))]


def reference_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The reference's nucleus draw, batched: sort each row, keep the tokens with at most `p` of the mass above
    them, renormalise, draw one per row; (bsz, 1) token indices."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs[mass_before > p] = 0.0
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.gather(order, -1, torch.multinomial(sorted_probs, num_samples=1))


def top_p_picks(model, prompt: List[int], generated: List[int], temperature: float, top_p: float) -> List[int]:
    """The reference's sampling written out, step by step from the current global RNG state: softmax(logits / T),
    keep the nucleus, renormalise, draw one; what it draws after prompt + generated[:i] for each i."""
    logits = full_logits(model, prompt + generated)[len(prompt) - 1 : -1]
    picks = []
    for step_logits in logits:
        probs = torch.softmax(step_logits / temperature, dim=-1)[None]  # (1, vocab): a batch of one, as generate's
        picks.append(int(reference_top_p(probs, top_p)[0, 0]))
    return picks


def chat_prompt(tokenizer, dialog) -> List[int]:
    """The Llama 3 chat format, built by hand from the special-token IDs: <|begin_of_text|>, then per message
    <|start_header_id|> role <|end_header_id|> "\n\n" content-stripped-of-surrounding-whitespace <|eot_id|>,
    then an assistant header with nothing after it."""

    def header(role):
        return [START_HEADER] + tokenizer.encode(role, bos=False, eos=False) + [END_HEADER] + [271]  # "\n\n"

    ids = [BOS]
    for message in dialog:
        ids += header(message["role"]) + tokenizer.encode(message["content"].strip(), bos=False, eos=False) + [EOT]
    return ids + header("assistant")


def encode(tokenizer, text: str) -> List[int]:
    return tokenizer.encode(text, bos=True, eos=False)


# A model that really produces stop tokens ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopping_llama(tiny_llama):
    """A copy of the tiny Llama whose output head makes greedy decoding say <|eot_id|> within 4 tokens of the
    chat prompt of DIALOG, and <|end_of_text|> within 6 tokens of TEXTS[1].

    The random model never picks a stop token by itself. Giving a stop token's output row 1.05 times the row
    of a token X that greedy decoding picks (with a positive logit) at some step makes the stop token beat X
    there, and beat every other token wherever X would have won. Returns (llama, chat prompt IDs).
    """
    tokenizer = tiny_llama.tokenizer
    chat_ids = chat_prompt(tokenizer, DIALOG)
    model = copy.deepcopy(tiny_llama.model)
    for prompt, step, stop in ((chat_ids, 3, EOT), (encode(tokenizer, TEXTS[1]), 5, EOS)):
        logits = full_logits(tiny_llama.model, prompt + greedy_alone(tiny_llama.model, prompt, step))[-1]
        x = int(logits.argmax())
        assert logits[x] > 0, "the trick needs the winner's logit to be positive"
        with torch.no_grad():
            model.output.weight[stop] = 1.05 * model.output.weight[x]
    return Llama(model, tokenizer), chat_ids


# Greedy decoding -------------------------------------------------------------------------------------------


def test_greedy_batch_of_unequal_prompts_equals_each_prompt_alone(tiny_llama):
    g = tiny_llama
    prompts = [[BOS]] + [encode(g.tokenizer, t) for t in TEXTS]  # lengths 1, 2, 6, 9
    out, logprobs = g.generate(prompts, max_gen_len=6, temperature=0)
    assert logprobs is None
    for prompt, tokens in zip(prompts, out):
        assert tokens == greedy_alone(g.model, prompt, 6)


def test_echo_returns_prompt_then_generation(tiny_llama):
    g = tiny_llama
    prompts = [encode(g.tokenizer, t) for t in TEXTS]
    with_echo, _ = g.generate(prompts, max_gen_len=5, temperature=0, echo=True)
    without, _ = g.generate(prompts, max_gen_len=5, temperature=0, echo=False)
    for prompt, echoed, plain in zip(prompts, with_echo, without):
        assert_greedy(g.model, prompt, plain, 5)
        assert echoed == prompt + plain


def test_text_completion_is_greedy_decoding_of_the_prompt_with_bos(tiny_llama):
    g = tiny_llama
    results = g.text_completion(TEXTS, temperature=0, max_gen_len=5, logprobs=True)
    for text, result in zip(TEXTS, results):
        prompt = g.tokenizer.encode(text, bos=True, eos=False)
        assert prompt[0] == BOS
        generated = greedy_alone(g.model, prompt, 5)
        assert result["generation"] == g.tokenizer.decode(generated)
        assert result["tokens"] == [g.tokenizer.decode([t]) for t in generated]  # each token decoded alone
        assert result["logprobs"] == pytest.approx(logprobs_alone(g.model, prompt + generated)[len(prompt) :], abs=1e-4)
    echoed = g.text_completion(TEXTS[:1], temperature=0, max_gen_len=3, echo=True)[0]["generation"]
    assert echoed.startswith("<|begin_of_text|>" + TEXTS[0])


def test_text_completion_results_have_the_reference_keys(tiny_llama):
    g = tiny_llama
    plain = g.text_completion(TEXTS[:2], temperature=0, max_gen_len=2)
    assert [set(r) for r in plain] == [{"generation"}] * 2
    assert all(isinstance(r["generation"], str) for r in plain)
    with_logprobs = g.text_completion(TEXTS[:2], temperature=0, max_gen_len=2, logprobs=True)
    assert [set(r) for r in with_logprobs] == [{"generation", "tokens", "logprobs"}] * 2
    assert [r["generation"] for r in with_logprobs] == [r["generation"] for r in plain]
    for r in with_logprobs:
        assert len(r["tokens"]) == len(r["logprobs"]) == 2
        assert all(isinstance(t, str) for t in r["tokens"])
        assert all(isinstance(lp, float) and lp <= 0 for lp in r["logprobs"])


# Logprobs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("echo", [False, True])
def test_logprobs_equal_log_softmax_of_previous_position(tiny_llama, echo):
    g = tiny_llama
    prompts = [encode(g.tokenizer, t) for t in TEXTS]
    out, logprobs = g.generate(prompts, max_gen_len=5, temperature=0, logprobs=True, echo=echo)
    for prompt, tokens, lps in zip(prompts, out, logprobs):
        assert len(lps) == len(tokens)
        full = tokens if echo else prompt + tokens
        expected = logprobs_alone(g.model, full)
        if echo:
            assert tokens[: len(prompt)] == prompt
            assert lps[0] == 0.0  # nothing precedes the first token
        else:
            expected = expected[len(prompt) :]
        assert lps == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("logprobs", [False, True])
def test_prompts_that_fill_the_window_score_each_token_against_the_previous_position(tiny_llama, logprobs):
    """A known bug of Meta's reference, fixed here: when the shortest prompt already has the total length (here
    max_gen_len 0 and prompts of one length), its `generate` scores token t against position t's own logits
    (`-F.cross_entropy(logits.transpose(1, 2), tokens)`, not shifted by one). We score token t against position
    t - 1's logits, as in every other case, and give the first token logprob 0."""
    g = tiny_llama
    prompts = [encode(g.tokenizer, "The capital of France is"), encode(g.tokenizer, "The capital of Spain is")]
    assert len(prompts[0]) == len(prompts[1])
    out, lps = g.generate(prompts, max_gen_len=0, temperature=0, logprobs=logprobs, echo=True)
    assert out == prompts
    if not logprobs:
        assert lps is None
        return
    for prompt, row in zip(prompts, lps):
        assert row[0] == 0.0
        assert row == pytest.approx(logprobs_alone(g.model, prompt), abs=1e-4)
    # The same through text_completion.
    result = g.text_completion(["The capital of France is"], max_gen_len=0, logprobs=True, echo=True)[0]
    assert result["generation"] == "<|begin_of_text|>The capital of France is"
    assert result["tokens"] == [g.tokenizer.decode([t]) for t in prompts[0]]
    assert result["logprobs"] == pytest.approx(logprobs_alone(g.model, prompts[0]), abs=1e-4)


def test_prompt_of_max_seq_len_tokens_is_scored_and_generates_nothing(tiny_llama):
    g = tiny_llama
    prompt = [BOS] + [(7919 * i) % 120000 for i in range(1, 64)]  # 64 = max_seq_len tokens
    out, lps = g.generate([prompt], max_gen_len=10, temperature=0, logprobs=True, echo=True)
    assert out == [prompt]
    assert lps[0] == pytest.approx(logprobs_alone(g.model, prompt), abs=1e-4)
    out, lps = g.generate([prompt], max_gen_len=10, temperature=0, logprobs=True)
    assert out == [[]] and lps == [[]]


# Stop tokens -----------------------------------------------------------------------------------------------


def test_stop_token_in_prompt_does_not_stop_generation(tiny_llama):
    g = tiny_llama
    short = encode(g.tokenizer, "Hello")  # 2 tokens: decoding starts at position 2
    with_eot = encode(g.tokenizer, "The capital") + [EOT] + g.tokenizer.encode(" of France is", bos=False, eos=False)
    assert with_eot.index(EOT) >= len(short)  # the prompt's <|eot_id|> sits where other rows generate
    prompts = [short, with_eot]
    out, lps = g.generate(prompts, max_gen_len=5, temperature=0, logprobs=True)
    for prompt, tokens in zip(prompts, out):
        assert_greedy(g.model, prompt, tokens, 5, g.tokenizer.stop_tokens)  # 5 tokens: nothing stopped them
    # With echo the output is cut before the first stop token, even one in the prompt (as the reference does).
    echoed, echoed_lps = g.generate(prompts, max_gen_len=5, temperature=0, echo=True, logprobs=True)
    assert echoed[0] == short + out[0]
    assert echoed[1] == with_eot[: with_eot.index(EOT)]
    assert echoed_lps[1] == pytest.approx(logprobs_alone(g.model, echoed[1]), abs=1e-4)


def test_stop_token_in_a_prompt_does_not_end_its_row_when_the_others_stop(stopping_llama):
    g, chat_ids = stopping_llama
    # Row 0 says <|eot_id|> within 4 tokens. Row 1 is longer and has <|eot_id|> in its prompt at the position
    # where row 0 starts generating: if that counted as row 1 stopping, decoding would end with row 1 unfinished.
    filler = g.tokenizer.encode(" the cat sat on the mat" * 8, bos=False, eos=False)
    row1 = [BOS] + filler[: len(chat_ids) - 1] + [EOT] + filler[:5]
    assert row1.index(EOT) == len(chat_ids)
    out, _ = g.generate([chat_ids, row1], max_gen_len=6, temperature=0)
    assert_greedy(g.model, chat_ids, out[0], 6, {EOT, EOS})
    assert len(out[0]) < 4
    assert_greedy(g.model, row1, out[1], 6, {EOT, EOS})


def test_generated_stop_tokens_cut_their_row_and_other_rows_continue(stopping_llama, tiny_llama):
    g, chat_ids = stopping_llama
    prompts = [chat_ids, encode(g.tokenizer, TEXTS[0]), encode(g.tokenizer, TEXTS[1])]
    out, lps = g.generate(prompts, max_gen_len=8, temperature=0, logprobs=True)
    stop_tokens = {EOT, EOS}
    for prompt, tokens in zip(prompts, out):
        assert_greedy(g.model, prompt, tokens, 8, stop_tokens)
    # Which stop token ended rows 0 and 2, and that row 1 ran to max_gen_len untouched by the change.
    assert greedy_picks(g.model, prompts[0], out[0])[-1] == EOT
    assert greedy_picks(g.model, prompts[2], out[2])[-1] == EOS
    assert len(out[0]) < 8 and len(out[2]) < 8
    assert_greedy(tiny_llama.model, prompts[1], out[1], 8)
    for prompt, tokens, row in zip(prompts, out, lps):
        assert row == pytest.approx(logprobs_alone(g.model, prompt + tokens)[len(prompt) :], abs=1e-4)

    # With echo the cut looks at the whole output: the chat prompt's own <|eot_id|> ends row 0 early.
    echoed, _ = g.generate(prompts, max_gen_len=8, temperature=0, echo=True)
    assert echoed[0] == chat_ids[: chat_ids.index(EOT)]
    assert echoed[1] == prompts[1] + out[1]
    assert echoed[2] == prompts[2] + out[2]


def test_decoding_stops_once_every_row_has_stopped(stopping_llama):
    g, chat_ids = stopping_llama
    calls = []
    forward = g.model.forward

    def counting_forward(tokens, *args, **kwargs):
        calls.append(tokens.shape)
        return forward(tokens, *args, **kwargs)

    g.model.forward = counting_forward
    try:
        out, _ = g.generate([chat_ids], max_gen_len=30, temperature=0)
    finally:
        del g.model.forward
    assert_greedy(g.model, chat_ids, out[0], 30, {EOT})
    assert len(calls) == len(out[0]) + 1  # one forward per generated token (<|eot_id|> included), none after


# Length limits ---------------------------------------------------------------------------------------------


def test_max_gen_len_zero_generates_nothing(tiny_llama):
    g = tiny_llama
    prompts = [encode(g.tokenizer, t) for t in TEXTS]
    out, lps = g.generate(prompts, max_gen_len=0, temperature=0, logprobs=True)
    assert out == [[], [], []] and lps == [[], [], []]
    assert g.text_completion(TEXTS, max_gen_len=0) == [{"generation": ""}] * 3


def test_total_length_is_capped_at_max_seq_len(tiny_llama):
    g = tiny_llama
    long_prompt = [BOS] + [(7919 * i) % 120000 for i in range(1, 60)]  # 60 tokens; max_seq_len is 64
    short_prompt = encode(g.tokenizer, TEXTS[1])
    out, _ = g.generate([long_prompt, short_prompt], max_gen_len=10, temperature=0)
    assert_greedy(g.model, long_prompt, out[0], 4)  # 64 - 60
    assert_greedy(g.model, short_prompt, out[1], 10)


def test_default_max_gen_len_fills_the_context(tiny_llama):
    g = tiny_llama
    prompt = encode(g.tokenizer, "Hello")
    result = g.text_completion(["Hello"], temperature=0, logprobs=True)[0]
    assert len(result["tokens"]) == len(result["logprobs"]) == 64 - len(prompt)


# Sampling --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_seeded_builds_sample_the_same_tokens(tiny_checkpoint, tokenizer_path, process_group):
    def sample(seed):
        g = Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=4, seed=seed, device="cpu")
        return g.text_completion(TEXTS[:2], max_gen_len=4, temperature=1.0, top_p=0.9)

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_top_p_sampling_equals_the_reference_algorithm(tiny_llama):
    g = tiny_llama
    prompt = encode(g.tokenizer, TEXTS[2])
    # A low temperature keeps the nucleus to a few well-separated tokens, so that tiny float differences
    # between the cached and the full forward cannot reorder it.
    temperature, top_p = 0.2, 0.9
    torch.manual_seed(1234)
    out, _ = g.generate([prompt], max_gen_len=8, temperature=temperature, top_p=top_p)
    assert len(out[0]) == 8
    torch.manual_seed(1234)
    assert out[0] == top_p_picks(g.model, prompt, out[0], temperature, top_p)[:8]
    assert out[0] != greedy_picks(g.model, prompt, out[0])[:8]  # the draws mattered: not just the argmax


def test_sample_top_p_with_tiny_p_returns_the_argmax():
    torch.manual_seed(0)
    probs = torch.distributions.Dirichlet(torch.ones(50)).sample((64,))  # (64, 50), each row sums to 1
    before = probs.clone()
    for _ in range(5):
        picked = sample_top_p(probs, 1e-6)
        assert picked.shape == (64, 1)
        assert torch.equal(picked[:, 0], probs.argmax(dim=-1))
    assert torch.equal(probs, before)  # the caller's tensor is left alone


@pytest.mark.parametrize(
    "p, nucleus",
    [
        (0.3, {1}),  # 0.4 alone already exceeds 0.3
        (0.6, {1, 2}),  # 0.4 < 0.6, 0.4 + 0.3 > 0.6
        (0.75, {1, 2, 3}),  # 0.7 < 0.75
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_sample_top_p_draws_only_from_the_nucleus_in_proportion(p, nucleus):
    probs = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    assert_nucleus_sampling(probs, p, nucleus)


def test_sample_top_p_keeps_a_token_whose_preceding_mass_equals_p():
    """The reference drops a token only when the mass before it *exceeds* p (dyadic values: exact in float)."""
    probs = torch.tensor([0.0625, 0.5, 0.25, 0.125, 0.0625])
    assert_nucleus_sampling(probs, 0.5, {1, 2})


def llama3_probs(rows: int, spread: float, seed: int, tie_at_top: bool = False) -> torch.Tensor:
    """softmax(logits / 0.6) over Llama 3's vocabulary, of bfloat16 logits (so many tokens share a probability)
    drawn with standard deviation `spread`: a few likely tokens for a large spread, thousands for a small one.
    With `tie_at_top`, two tokens share the highest probability."""
    logits = (torch.randn(rows, 128256, generator=torch.Generator().manual_seed(seed)) * spread).bfloat16().float()
    if tie_at_top:
        logits[:, [9, 70000]] = logits.amax(dim=-1, keepdim=True) + 1
    return torch.softmax(logits / 0.6, dim=-1)


@pytest.mark.parametrize("p", [0.9, 0.5, 0.99, 1e-6, 1.0])
@pytest.mark.parametrize(
    "rows, spread, tie_at_top",
    [(1, 10.0, False), (3, 4.0, False), (1, 10.0, True), (2, 4.0, True), (1, 0.5, False), (2, 0.5, True)],
)
def test_sample_top_p_draws_the_references_tokens_from_the_same_seed(rows, spread, tie_at_top, p):
    """On CPU only the head of each row is ranked (torch.topk) unless the nucleus is large: the same tokens, and the
    random generator left in the same state, as the reference's full sort, also when the drawn token's probability
    is shared (which the unstable sort orders its own way)."""
    probs = llama3_probs(rows, spread, seed=rows + int(10 * spread), tie_at_top=tie_at_top)
    for seed in range(4):
        torch.manual_seed(seed)
        expected, expected_next = reference_top_p(probs.clone(), p), torch.rand(4)
        torch.manual_seed(seed)
        assert torch.equal(sample_top_p(probs, p), expected)
        assert torch.equal(torch.rand(4), expected_next)


def test_greedy_pick_is_torch_argmax():
    logits = torch.tensor([[1.0, 3.0, float("nan"), 3.0, float("nan")], [0.0, -0.0, 0.0, -1.0, -1.0]])
    logits = torch.cat([logits, torch.full((2, 128251), -2.0)], dim=1)
    wide = torch.randn(4, 3, 128256)[:, -1]  # a strided view, as generate passes it
    for x in (logits, wide, logits.bfloat16()):
        assert torch.equal(greedy_pick(x), torch.argmax(x, dim=-1))


def assert_nucleus_sampling(probs, p, nucleus):
    torch.manual_seed(0)
    n = 20000
    picked = sample_top_p(probs.repeat(n, 1), p)[:, 0]
    counts = torch.bincount(picked, minlength=5).float() / n
    assert set(picked.tolist()) == nucleus
    mass = sum(probs[i].item() for i in nucleus)
    for i in range(5):
        expected = probs[i].item() / mass if i in nucleus else 0.0
        assert math.isclose(counts[i].item(), expected, abs_tol=0.02)


# Chat ------------------------------------------------------------------------------------------------------


def test_chat_completion_is_greedy_decoding_of_the_chat_format(tiny_llama):
    g = tiny_llama
    dialogs = [DIALOG, [{"role": "user", "content": "Hi!"}]]
    results = g.chat_completion(dialogs, temperature=0, max_gen_len=5)
    with_logprobs = g.chat_completion(dialogs, temperature=0, max_gen_len=5, logprobs=True)
    for dialog, result, result_lp in zip(dialogs, results, with_logprobs):
        ids = chat_prompt(g.tokenizer, dialog)
        expected = greedy_alone(g.model, ids, 5)
        assert not set(expected) & g.tokenizer.stop_tokens
        answer = {"role": "assistant", "content": g.tokenizer.decode(expected)}
        assert result == {"generation": answer, "stop_reason": "length"}
        assert set(result_lp) == {"generation", "tokens", "logprobs", "stop_reason"}
        assert result_lp["generation"] == answer and result_lp["stop_reason"] == "length"
        assert result_lp["tokens"] == [g.tokenizer.decode([t]) for t in expected]
        assert result_lp["logprobs"] == pytest.approx(logprobs_alone(g.model, ids + expected)[len(ids) :], abs=1e-4)


def test_chat_completion_ends_at_end_of_turn(stopping_llama):
    g, chat_ids = stopping_llama
    assert chat_ids == chat_prompt(g.tokenizer, DIALOG)
    hello = [{"role": "user", "content": "Hello"}]
    hello_ids = chat_prompt(g.tokenizer, hello)
    results = g.chat_completion([DIALOG, hello], temperature=0, max_gen_len=8, logprobs=True)
    # The answers' IDs, checked to be greedy decoding of the hand-built chat prompts.
    (answer, other), _ = g.generate([chat_ids, hello_ids], max_gen_len=8, temperature=0)
    assert_greedy(g.model, chat_ids, answer, 8, {EOT, EOS})
    assert greedy_picks(g.model, chat_ids, answer)[-1] == EOT and len(answer) < 8
    assert_greedy(g.model, hello_ids, other, 8, {EOT, EOS})
    assert len(other) == 8

    assert results[0]["generation"] == {"role": "assistant", "content": g.tokenizer.decode(answer)}
    assert results[0]["stop_reason"] == "end_of_turn"
    assert results[0]["tokens"] == [g.tokenizer.decode([t]) for t in answer]
    assert len(results[0]["logprobs"]) == len(answer)
    assert results[1]["generation"] == {"role": "assistant", "content": g.tokenizer.decode(other)}
    assert results[1]["stop_reason"] == "length"


EOM = 128008  # <|eom_id|> in Llama 3.1; <|reserved_special_token_4|> in Llama 3


def test_eom_stops_llama31_chat_and_is_reported(tiny_llama, tokenizer_path):
    """With Llama 3.1 names, <|eom_id|> ends the answer as "end_of_message"; for Llama 3 it is ordinary."""
    from llama.tokenizer import Tokenizer

    tokenizer31 = Tokenizer(tokenizer_path, version="3.1")
    dialog = [{"role": "user", "content": "Call the weather tool."}]
    chat_ids = chat_prompt(tiny_llama.tokenizer, dialog)
    model = copy.deepcopy(tiny_llama.model)
    logits = full_logits(tiny_llama.model, chat_ids + greedy_alone(tiny_llama.model, chat_ids, 2))[-1]
    x = int(logits.argmax())
    assert logits[x] > 0, "the trick needs the winner's logit to be positive"
    with torch.no_grad():
        model.output.weight[EOM] = 1.05 * model.output.weight[x]

    llama31, llama3 = Llama(model, tokenizer31), Llama(model, tiny_llama.tokenizer)
    (answer,), _ = llama3.generate([chat_ids], max_gen_len=8, temperature=0)
    assert EOM in answer, "the modified head makes greedy decoding emit <|eom_id|>"
    cut = answer[: answer.index(EOM)]

    result = llama31.chat_completion([dialog], temperature=0, max_gen_len=8)[0]
    assert result["generation"]["content"] == tokenizer31.decode(cut)
    assert result["stop_reason"] == "end_of_message"
    chunks = list(llama31.chat_completion_stream([dialog], temperature=0, max_gen_len=8))
    assert "".join(c.text for c in chunks) == tokenizer31.decode(cut)
    assert chunks[-1].stop_reason == "end_of_message"

    as_llama3 = llama3.chat_completion([dialog], temperature=0, max_gen_len=8)[0]
    assert as_llama3["stop_reason"] == "length"  # Llama 3 keeps the reference's stop tokens exactly
    assert "<|reserved_special_token_4|>" in as_llama3["generation"]["content"]
