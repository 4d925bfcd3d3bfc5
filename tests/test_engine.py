"""Continuous batching (`llama.serve.engine`) in this process, without HTTP: rows at positions of their own, prompts
prefilled into one row, and requests that join a running batch."""

import threading

import pytest
import torch
from helpers import ATOL, GQA_PARAMS, load_tiny

from llama.checkpoint import random_weights
from llama.serve.engine import Engine
from llama.serve.requests import Request


def test_rows_at_different_positions_decode_as_each_would_alone(process_group, tmp_path):
    """One decode step with a position per row gives each row the logits `forward` gives its sequence alone."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=3), torch.float32)
    generator = torch.Generator().manual_seed(1)
    short, long = (torch.randint(0, GQA_PARAMS["vocab_size"], (1, n), generator=generator) for n in (5, 11))
    expected = [model(seq, 0)[0, -1] for seq in (short, long)]  # each alone, in row 0
    for row, seq in enumerate((short, long)):  # each prompt but its last token, into its own row
        model(seq[:, :-1], 0, first_row=row)
    logits = model.decode_step(torch.stack([short[:, -1], long[:, -1]]), torch.tensor([4, 10]))
    assert expected[0].abs().max() > 1
    for row in range(2):
        assert (logits[row, -1] - expected[row]).abs().max() < ATOL


def test_a_prompt_prefilled_into_one_row_leaves_the_other_alone(process_group, tmp_path):
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=4), torch.float32)
    model(torch.arange(1, 21)[None].repeat(2, 1), 0)
    cache = model.layers[0].attention.kv_cache
    row0 = cache.cache_k[0].clone()
    model(torch.arange(30, 38)[None], 0, first_row=1)
    assert torch.equal(cache.cache_k[0], row0)
    assert not torch.equal(cache.cache_k[1, :8], row0[:8])


def run_requests(engine, prompts, max_tokens, start_after=None):
    """Each prompt's tokens and finish, greedy; prompt i is submitted once prompt `start_after[i]` has its first
    token (None: at once)."""
    outputs = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]
    done = threading.Semaphore(0)

    def emit(i, output):
        outputs[i].append(output)
        started[i].set()
        if output.finish is not None:
            done.release()

    thread = threading.Thread(target=engine.run)
    thread.start()
    for i, prompt in enumerate(prompts):
        if start_after and start_after[i] is not None:
            started[start_after[i]].wait()
        engine.submit(Request(prompt, max_tokens[i], 0.0, 0.9, emit=lambda out, i=i: emit(i, out)))
    for _ in prompts:
        done.acquire()
    engine.stop()
    thread.join()
    return [[o.token for o in out if o.token is not None] for out in outputs], [out[-1].finish for out in outputs]


@pytest.mark.slow
def test_requests_joining_a_running_batch_get_their_solo_greedy_tokens(tiny_llama):
    """Five requests over four rows, each started after another has begun; prompts of 1 to 3 prefill chunks."""
    tokenizer = tiny_llama.tokenizer
    texts = ["Hello", "The quick brown fox jumps over the lazy dog " * 2, "a", "1 2 3 4 5 6 7 8 9", "Why not?"]
    prompts = [tokenizer.encode(text, bos=True, eos=False) for text in texts]
    max_tokens = [12, 20, 30, 8, 15]
    solo = [tiny_llama.generate([p], n, temperature=0)[0][0] for p, n in zip(prompts, max_tokens)]
    engine = Engine(tiny_llama.model, tokenizer, prefill_chunk=8)
    tokens, finishes = run_requests(engine, prompts, max_tokens, start_after=[None, 0, 1, 2, 3])
    assert tokens == solo
    assert finishes == ["length" if len(t) == n else "end_of_turn" for t, n in zip(solo, max_tokens)]
    assert engine.load()["free_rows"] == 4


def test_a_cancelled_request_frees_its_row_at_the_next_step(tiny_llama):
    engine = Engine(tiny_llama.model, tiny_llama.tokenizer)
    got = []

    def emit(output):  # cancels itself on its second token
        got.append(output)
        if len(got) == 2:
            engine.cancel(request)

    request = Request([1, 2, 3], 60, 0.0, 0.9, emit=emit)
    engine.submit(request)
    engine.step()  # prefill: the first token
    engine.step()  # the second
    assert engine.load()["running"] == 1
    engine.step()
    assert engine.load()["running"] == 0 and len(got) == 2  # freed; nothing more sent


@pytest.mark.slow
def test_a_request_alone_gets_generate_s_tokens_in_bfloat16(tiny_checkpoint, tokenizer_path, process_group):
    """Alone, a request steps as `Llama.generate` does, so even in bfloat16 (where a batched step rounds
    otherwise) its greedy and seeded tokens are generate's."""
    from llama import Llama

    generator = Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=4, device="cpu",
                            dtype="bfloat16")  # fmt: skip
    engine = Engine(generator.model, generator.tokenizer)
    for text, temperature in [("Hello there", 0.0), ("The quick brown fox", 0.0), ("Why?", 0.8)]:
        prompt = generator.tokenizer.encode(text, bos=True, eos=False)
        torch.manual_seed(11)
        expected = generator.generate([prompt], 30, temperature=temperature, top_p=0.9)[0][0]
        got = []
        engine.submit(Request(prompt, 30, temperature, 0.9, emit=got.append, seed=11))
        while engine.load()["running"] or engine.load()["waiting"]:
            engine.step()
        assert [o.token for o in got if o.token is not None] == expected
