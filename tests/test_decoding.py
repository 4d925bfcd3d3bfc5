"""llama.decoding.batch.BatchDecoder on its own: a stand-in model and tokenizer, no checkpoint and no `Llama`.

The stand-in model predicts, at every position, the token after the one there (token + 1), so each output is
known in advance and every rule of batch decoding can be checked exactly: the prompts' layout, which positions
are fed at each step, the rows that keep their prompt tokens, the cut at a stop token, streaming, and the prefix of
a prompt that the cache already holds from the call before.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from llama import StreamChunk
from llama.decoding.batch import BatchDecoder
from llama.model import ModelArgs
from llama.runtime.cached_tokens import CachedTokens
from llama.text import stream_chunks

VOCAB = 32
STOP = 20  # the stand-in tokenizer's only stop token


class CountingModel:
    """The `Transformer` interface that `BatchDecoder` uses, predicting token + 1 at every position."""

    def __init__(self, max_seq_len: int = 16, max_batch_size: int = 4):
        self.params = ModelArgs(dim=8, n_layers=1, n_heads=1, vocab_size=VOCAB, max_seq_len=max_seq_len,
                                max_batch_size=max_batch_size)  # fmt: skip
        self.tok_embeddings = SimpleNamespace(weight=torch.zeros(1))
        self.fed = []  # (start_pos, number of positions) of every call
        self.cached = CachedTokens(max_batch_size)  # what `RuntimeTransformer.forward` keeps up to date

    def forward(self, tokens: torch.Tensor, start_pos: int, last_logits_only: bool = False) -> torch.Tensor:
        self.fed.append((start_pos, tokens.shape[1]))
        for row, row_tokens in enumerate(tokens.tolist()):
            self.cached.wrote(row, start_pos, row_tokens)
        logits = 10.0 * F.one_hot((tokens + 1) % VOCAB, VOCAB).float()
        return logits[:, -1:] if last_logits_only else logits


def tokenizer():
    return SimpleNamespace(
        pad_id=-1,
        stop_tokens={STOP},
        special_tokens={},  # STOP is no named stop token: it ends a turn
        decode_bytes=lambda tokens: "".join(chr(ord("a") + t) for t in tokens).encode(),
    )


def test_greedy_rows_count_on_from_their_own_prompts():
    model = CountingModel()
    out, logprobs, reasons = BatchDecoder(model, tokenizer()).run([[1, 2, 3], [7]], 4, 0, 0.9, False, False)
    assert out == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert logprobs == [None, None]
    assert reasons == ["length", "length"]
    # Decoding starts at the shortest prompt's end; each step feeds only the positions not yet in the cache.
    assert model.fed == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]  # the table is 3 + 4 positions long


def test_echo_returns_prompt_and_generation():
    out, _, _ = BatchDecoder(CountingModel(), tokenizer()).run([[1, 2]], 3, 0, 0.9, False, echo=True)
    assert out == [[1, 2, 3, 4, 5]]


def test_a_stop_token_cuts_its_row_and_the_others_go_on():
    # Row 0 reaches the stop token (20) after two tokens; row 1 never does within 6 tokens.
    out, _, reasons = BatchDecoder(CountingModel(), tokenizer()).run([[17, 18], [1, 2]], 6, 0, 0.9, False, False)
    assert out == [[19], [3, 4, 5, 6, 7, 8]]
    assert reasons == ["end_of_turn", "length"]


def test_decoding_stops_when_every_row_has_stopped():
    model = CountingModel()
    out, _, reasons = BatchDecoder(model, tokenizer()).run([[18], [19]], 10, 0, 0.9, False, False)
    assert out == [[19], []]
    assert reasons == ["end_of_turn", "end_of_turn"]
    assert len(model.fed) == 2  # not the 10 steps max_gen_len allows


def test_the_context_caps_the_output():
    out, _, reasons = BatchDecoder(CountingModel(max_seq_len=5), tokenizer()).run([[1, 2]], 10, 0, 0.9, False, False)
    assert out == [[3, 4, 5]]
    assert reasons == ["length"]


def test_logprobs_are_those_of_the_predicted_tokens():
    _, logprobs, _ = BatchDecoder(CountingModel(), tokenizer()).run([[1, 2]], 2, 0, 0.9, True, False)
    # Every generated token is the model's argmax, whose log-softmax over logits 10 and 0 is known.
    expected = -torch.log1p((VOCAB - 1) * torch.exp(torch.tensor(-10.0))).item()
    assert logprobs[0] == pytest.approx([expected, expected], rel=1e-3)  # computed in float32


def test_streamed_chunks_join_to_the_run_output():
    prompts = [[17, 18], [1, 2]]
    stand_in = tokenizer()
    chunks = list(stream_chunks(stand_in, BatchDecoder(CountingModel(), stand_in).stream(prompts, 6, 0, 0.9)))
    assert all(isinstance(chunk, StreamChunk) for chunk in chunks)  # the type the package exports
    texts = {i: "".join(c.text for c in chunks if c.index == i) for i in (0, 1)}
    assert texts == {0: "t", 1: "defghi"}  # tokens [19] and [3, ..., 8] as the stand-in decodes them
    last = {c.index: c for c in chunks if c.finished}
    assert (last[0].stop_reason, last[0].n_tokens) == ("end_of_turn", 1)
    assert (last[1].stop_reason, last[1].n_tokens) == ("length", 6)


def test_bad_batches_are_refused_before_decoding():
    model = CountingModel(max_batch_size=2)
    decoder = BatchDecoder(model, tokenizer())
    with pytest.raises(ValueError, match="max_batch_size=2"):
        decoder.run([[1], [2], [3]], 2, 0, 0.9, False, False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.run([[1, VOCAB]], 2, 0, 0.9, False, False)
    with pytest.raises(ValueError, match="top_p"):
        decoder.run([[1]], 2, 0.5, 0.0, False, False)
    assert model.fed == []


def test_sample_next_falls_back_to_greedy_only_in_rows_that_overflow():
    from llama.decoding.sampling import sample_next, sample_top_p

    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1e30, 2e30, 0.0, -1e30]])
    # At 1e-9, row 0's scaled logits (about 3e9) are finite and the draw is certain; row 1's overflow to inf.
    assert sample_next(logits, 1e-9, 0.9).tolist() == [[2], [1]]
    # Where nothing overflows, the draw is Meta's: softmax(logits / temperature), then sample_top_p, same generator.
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    ours = sample_next(logits, 0.6, 0.9)
    torch.manual_seed(5)
    assert torch.equal(ours, sample_top_p(torch.softmax(logits / 0.6, dim=-1), 0.9))


def test_a_prompt_that_repeats_the_last_call_runs_only_its_new_tokens():
    model = CountingModel(max_seq_len=32)
    decoder = BatchDecoder(model, tokenizer())
    out, _, _ = decoder.run([[1, 2, 3]], 4, 0, 0.9, False, False)  # the cache holds 1 2 3 4 5 6 (7 is not fed)
    model.fed.clear()
    again, _, _ = decoder.run([[1, 2, 3] + out[0] + [9, 10]], 2, 0, 0.9, False, False)
    assert again == [[11, 12]]
    assert model.fed[0] == (6, 3)  # 7, 9 and 10: the cache held the six before
    assert decoder.last_reused == [6]


def test_an_edited_prompt_runs_from_its_first_changed_token():
    model = CountingModel(max_seq_len=32)
    decoder = BatchDecoder(model, tokenizer())
    decoder.run([[1, 2, 3, 4, 5]], 2, 0, 0.9, False, False)
    model.fed.clear()
    out, _, _ = decoder.run([[1, 2, 8, 9]], 2, 0, 0.9, False, False)
    assert out == [[10, 11]]
    assert model.fed[0] == (2, 2)


def test_a_batch_starts_where_every_row_holds_its_prompt():
    model = CountingModel(max_seq_len=32)
    decoder = BatchDecoder(model, tokenizer())
    decoder.run([[1, 2, 3, 4], [5, 6]], 1, 0, 0.9, False, False)  # the rows hold 1 2 3 4 and 5 6 7 8
    model.fed.clear()
    decoder.run([[1, 2, 3, 4, 5, 6], [5, 6, 9, 10]], 1, 0, 0.9, False, False)
    assert model.fed[0] == (2, 2)  # row 1 holds two tokens of its prompt, row 0 four: both from position 2
    assert decoder.last_reused == [2, 2]


def test_the_whole_prompt_runs_without_prefix_cache_or_with_echoed_logprobs():
    model = CountingModel(max_seq_len=32)
    for decoder, logprobs in [(BatchDecoder(model, tokenizer(), prefix_cache=False), False),
                              (BatchDecoder(model, tokenizer()), True)]:  # fmt: skip
        decoder.run([[1, 2, 3]], 2, 0, 0.9, False, False)
        model.fed.clear()
        out, probs, _ = decoder.run([[1, 2, 3, 4]], 2, 0, 0.9, logprobs, echo=True)
        assert model.fed[0] == (0, 4)
        assert out == [[1, 2, 3, 4, 5, 6]]
        if logprobs:
            assert probs[0][0] == 0 and all(p < 0 for p in probs[0][1:])  # each prompt token after the first scored
