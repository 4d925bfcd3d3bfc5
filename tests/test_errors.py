"""User mistakes get a ValueError or FileNotFoundError (never an AssertionError) whose message names the problem.

`pytest.raises(ValueError)` would not catch an AssertionError, so each test also checks the error type.
"""

import json
import re

import pytest
import torch
from helpers import TINY_PARAMS, make_checkpoint

from llama import Llama, ModelArgs
from llama.checkpoint import check_model_parallel_size, random_weights, write_meta_checkpoint
from llama.distributed import resolve_device

BOS = 128000


def build(ckpt_dir, tokenizer_path, **kwargs):
    kwargs = {"max_seq_len": 64, "max_batch_size": 4, "device": "cpu", **kwargs}
    return Llama.build(str(ckpt_dir), tokenizer_path, **kwargs)


@pytest.fixture(scope="module")
def tiny_weights():
    """The tensors of the tiny checkpoint (the same seed as `tiny_checkpoint`), to write altered copies of."""
    return random_weights(TINY_PARAMS, seed=0)


def write_altered(out_dir, tensors):
    write_meta_checkpoint(out_dir, TINY_PARAMS, tensors)
    return out_dir


# Files and folders -----------------------------------------------------------------------------------------


def test_missing_checkpoint_dir(tmp_path, tokenizer_path, process_group):
    missing = tmp_path / "no_such_dir"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build(missing, tokenizer_path)


def test_folder_without_params_or_config(tmp_path, tokenizer_path, process_group):
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as e:
        build(tmp_path, tokenizer_path)
    assert "params.json" in str(e.value) and "config.json" in str(e.value)


def test_missing_tokenizer_file(tiny_checkpoint, tmp_path, process_group):
    missing = tmp_path / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build(tiny_checkpoint, str(missing))
    # No tokenizer_path, and none next to the checkpoint either.
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        build(tiny_checkpoint, None)


def test_params_json_without_pth_files(tmp_path, tokenizer_path, process_group):
    (tmp_path / "params.json").write_text(json.dumps(TINY_PARAMS))
    with pytest.raises(FileNotFoundError) as e:
        build(tmp_path, tokenizer_path)
    assert ".pth" in str(e.value) and str(tmp_path) in str(e.value)


# Checkpoints that do not fit ---------------------------------------------------------------------------------


def test_vocab_size_differs_from_the_tokenizer(tmp_path, tokenizer_path, process_group):
    ckpt = make_checkpoint(tmp_path / "small_vocab", params=dict(TINY_PARAMS, vocab_size=1000))
    with pytest.raises(ValueError) as e:
        build(ckpt, tokenizer_path)
    assert "1000" in str(e.value) and "128256" in str(e.value)


def test_model_parallel_size_that_cannot_split_the_model():
    # 4 query heads, 2 kv heads, FFN width 192, vocab 128256: only 1 and 2 divide all of them.
    args = ModelArgs(**TINY_PARAMS)
    check_model_parallel_size(args, 2)  # works: no error
    with pytest.raises(ValueError) as e:
        check_model_parallel_size(args, 3)
    assert "3" in str(e.value) and "[1, 2]" in str(e.value)


def test_model_parallel_size_other_than_the_running_one(tiny_checkpoint, tokenizer_path, process_group):
    # This test process is a group of one, with model parallelism of size 1 already set up.
    with pytest.raises(ValueError) as e:
        build(tiny_checkpoint, tokenizer_path, model_parallel_size=2)
    assert "1" in str(e.value) and "2" in str(e.value)


def test_checkpoint_missing_a_key(tmp_path, tokenizer_path, tiny_weights, process_group):
    tensors = {k: v for k, v in tiny_weights.items() if k != "norm.weight"}
    ckpt = write_altered(tmp_path / "missing", tensors)
    with pytest.raises(ValueError) as e:
        build(ckpt, tokenizer_path)
    assert "norm.weight" in str(e.value) and "missing" in str(e.value)


def test_checkpoint_with_an_unexpected_key(tmp_path, tokenizer_path, tiny_weights, process_group):
    tensors = dict(tiny_weights, **{"foo.weight": torch.zeros(3)})
    ckpt = write_altered(tmp_path / "extra", tensors)
    with pytest.raises(ValueError) as e:
        build(ckpt, tokenizer_path)
    assert "foo.weight" in str(e.value) and "unexpected" in str(e.value)


def test_checkpoint_with_rope_freqs_loads_and_ignores_it(tmp_path, tokenizer_path, tiny_weights, monkeypatch):
    """Some Meta checkpoints carry a precomputed `rope.freqs`; it is ignored, not an unexpected key. (Both loads on
    the reference's `F.linear`: loads that measure their kernels may choose others, which round differently.)"""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "linear")
    tensors = dict(tiny_weights, **{"rope.freqs": torch.full((8,), 123.0)})
    g = build(write_altered(tmp_path / "rope_freqs", tensors), tokenizer_path)
    plain = build(write_altered(tmp_path / "plain", dict(tiny_weights)), tokenizer_path)
    tokens = torch.tensor([[BOS, 9906, 1917]])
    with torch.inference_mode():
        assert torch.equal(g.model.forward(tokens, 0), plain.model.forward(tokens, 0))


def test_checkpoint_with_a_wrong_shape(tmp_path, tokenizer_path, tiny_weights, process_group):
    tensors = dict(tiny_weights, **{"layers.1.ffn_norm.weight": torch.ones(32, dtype=torch.bfloat16)})
    ckpt = write_altered(tmp_path / "shape", tensors)
    with pytest.raises(ValueError) as e:
        build(ckpt, tokenizer_path)
    message = str(e.value)
    assert "layers.1.ffn_norm.weight" in message and "32" in message and "64" in message


# Build arguments -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_seq_len", [0, -5])
def test_max_seq_len_below_one(tiny_checkpoint, tokenizer_path, process_group, max_seq_len):
    with pytest.raises(ValueError, match="max_seq_len"):
        build(tiny_checkpoint, tokenizer_path, max_seq_len=max_seq_len)


def test_max_seq_len_beyond_the_llama3_context(tiny_checkpoint, tokenizer_path, process_group):
    with pytest.raises(ValueError) as e:
        build(tiny_checkpoint, tokenizer_path, max_seq_len=8193)
    assert "8193" in str(e.value) and "8192" in str(e.value)


def test_max_seq_len_with_scaled_rope_goes_to_131072(tmp_path, tokenizer_path, process_group):
    ckpt = make_checkpoint(tmp_path / "llama31", params=dict(TINY_PARAMS, use_scaled_rope=True))
    g = build(ckpt, tokenizer_path, max_seq_len=8193, max_batch_size=1)  # beyond Llama 3, fine for Llama 3.1
    assert g.model.params.max_seq_len == 8193
    with pytest.raises(ValueError) as e:
        build(ckpt, tokenizer_path, max_seq_len=131073)
    assert "131073" in str(e.value) and "131072" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda(tiny_checkpoint, tokenizer_path, process_group):
    with pytest.raises(ValueError, match="CUDA"):
        build(tiny_checkpoint, tokenizer_path, device="cuda")


def test_more_processes_than_gpus_is_refused_with_the_fix(monkeypatch):
    """torchrun --nproc_per_node 2 on a machine with one GPU: the second process is told why it has no GPU and what
    to run instead (not CUDA's "invalid device ordinal" from deep inside torch)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device(None) == resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for device in (None, "cuda"):
        with pytest.raises(ValueError, match=r"process 1 .* only 1 GPU.*--nproc_per_node 1.*--device cpu"):
            resolve_device(device)
    assert resolve_device("cpu") == torch.device("cpu")


def test_unknown_device(tiny_checkpoint, tokenizer_path, process_group):
    with pytest.raises(ValueError, match="banana"):
        build(tiny_checkpoint, tokenizer_path, device="banana")


def test_unknown_dtype(tiny_checkpoint, tokenizer_path, process_group):
    with pytest.raises(ValueError, match="float8"):
        build(tiny_checkpoint, tokenizer_path, dtype="float8")


# Generation arguments --------------------------------------------------------------------------------------


def test_batch_larger_than_max_batch_size(tiny_llama):
    with pytest.raises(ValueError) as e:
        tiny_llama.generate([[BOS, 9906]] * 5, max_gen_len=2)
    assert "5" in str(e.value) and "max_batch_size=4" in str(e.value)
    with pytest.raises(ValueError, match="5"):
        tiny_llama.text_completion(["Hello"] * 5, max_gen_len=2)


def test_prompt_longer_than_max_seq_len(tiny_llama):
    with pytest.raises(ValueError) as e:
        tiny_llama.generate([[BOS, 9906], [BOS] * 65], max_gen_len=2)
    message = str(e.value)
    assert "Prompt 1" in message and "65" in message and "64" in message


def test_empty_prompt_lists(tiny_llama):
    with pytest.raises(ValueError, match="[Nn]o prompts"):
        tiny_llama.generate([], max_gen_len=2)
    with pytest.raises(ValueError, match="[Nn]o prompts"):
        tiny_llama.text_completion([], max_gen_len=2)


def test_empty_prompts(tiny_llama):
    with pytest.raises(ValueError) as e:
        tiny_llama.text_completion(["Hello", ""], max_gen_len=2)
    assert "Prompt 1" in str(e.value) and "empty" in str(e.value)
    with pytest.raises(ValueError) as e:
        tiny_llama.generate([[BOS], []], max_gen_len=2)
    assert "Prompt 1" in str(e.value) and "empty" in str(e.value)


@pytest.mark.parametrize("bad_token", [-1, 128256])
def test_token_ids_outside_the_vocabulary(tiny_llama, bad_token):
    """The vocab-parallel embedding turns such IDs into zero vectors: without a check they silently generate
    from a corrupted prompt."""
    with pytest.raises(ValueError) as e:
        tiny_llama.generate([[BOS, 9906], [BOS, bad_token, 9906]], max_gen_len=2)
    assert "Prompt 1" in str(e.value) and str(bad_token) in str(e.value) and "128256" in str(e.value)


def test_a_single_prompt_not_wrapped_in_a_list(tiny_llama):
    """A common slip: without a check, a str is iterated as one prompt per character, and a flat list of IDs or
    a single dialog fails deep inside with a TypeError."""
    with pytest.raises(ValueError, match="list"):
        tiny_llama.text_completion("Hi", max_gen_len=1)
    with pytest.raises(ValueError, match="list"):
        tiny_llama.generate([BOS, 9906], max_gen_len=1)
    with pytest.raises(ValueError, match="list"):
        tiny_llama.chat_completion([{"role": "user", "content": "Hi"}], max_gen_len=1)


def test_empty_dialogs(tiny_llama):
    with pytest.raises(ValueError, match="[Nn]o dialogs"):
        tiny_llama.chat_completion([], max_gen_len=2)
    with pytest.raises(ValueError) as e:
        tiny_llama.chat_completion([[{"role": "user", "content": "Hi"}], []], max_gen_len=2)
    assert "Dialog 1" in str(e.value) and "empty" in str(e.value)


def test_unknown_chat_role(tiny_llama):
    with pytest.raises(ValueError) as e:
        tiny_llama.chat_completion([[{"role": "robot", "content": "Hi"}]], max_gen_len=2)
    assert "robot" in str(e.value) and "user" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": -0.1}, ["temperature", "-0.1"]),
        ({"top_p": 0.0}, ["top_p", "0.0"]),
        ({"top_p": -0.1}, ["top_p", "-0.1"]),
        ({"top_p": 1.5}, ["top_p", "1.5"]),
        ({"max_gen_len": -1}, ["max_gen_len", "-1"]),
    ],
)
def test_bad_sampling_parameters(tiny_llama, kwargs, words):
    calls = {
        "generate": lambda: tiny_llama.generate([[BOS, 9906]], **{"max_gen_len": 2, **kwargs}),
        "text_completion": lambda: tiny_llama.text_completion(["Hello"], **{"max_gen_len": 2, **kwargs}),
        "chat_completion": lambda: tiny_llama.chat_completion(
            [[{"role": "user", "content": "Hi"}]], **{"max_gen_len": 2, **kwargs}
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as e:
            call()
        assert all(w in str(e.value) for w in words), f"{name}: {e.value}"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": float("nan")}, ["temperature", "nan"]),
        ({"temperature": float("inf")}, ["temperature", "inf"]),
        ({"temperature": 10**400}, ["temperature", "finite"]),
        ({"temperature": True}, ["temperature", "True"]),
        ({"temperature": None}, ["temperature", "None"]),
        ({"temperature": "0.6"}, ["temperature", "'0.6'"]),
        ({"top_p": True}, ["top_p", "True"]),
        ({"top_p": float("nan")}, ["top_p", "nan"]),
        ({"top_p": None}, ["top_p", "None"]),
        ({"max_gen_len": True}, ["max_gen_len", "True"]),
        ({"max_gen_len": 2.0}, ["max_gen_len", "2.0"]),
    ],
)
def test_sampling_parameters_of_the_wrong_kind(tiny_llama, kwargs, words):
    """NaN was accepted, top_p=True crashed in torch, max_gen_len=True generated one token."""
    test_bad_sampling_parameters(tiny_llama, kwargs, words)


@pytest.mark.parametrize("flag", [True, False])
def test_bools_are_not_token_ids(tiny_llama, flag):
    """They were taken as token IDs 1 and 0."""
    with pytest.raises(ValueError, match=rf"Prompt 0: token ID {flag} at position 1 is not an int"):
        tiny_llama.generate([[BOS, flag]], max_gen_len=1)


def test_numpy_integers_are_token_ids_and_lengths(tiny_llama):
    import numpy as np

    prompt = [BOS, 9906, 1917]
    expected = tiny_llama.generate([prompt], max_gen_len=4, temperature=0)
    assert tiny_llama.generate([list(np.array(prompt))], max_gen_len=np.int64(4), temperature=0) == expected
    assert tiny_llama.generate([[np.int32(x) for x in prompt]], max_gen_len=4, temperature=np.float64(0.0)) == expected


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 5e-39, 1e-30])
def test_a_tiny_temperature_decodes_greedily(tiny_llama, temperature):
    """logits / 1e-300 overflows float32: the softmax was all NaN and torch.multinomial raised."""
    prompts = [[BOS, 9906, 1917], [BOS, 791]]
    greedy = tiny_llama.generate(prompts, max_gen_len=6, temperature=0)
    assert tiny_llama.generate(prompts, max_gen_len=6, temperature=temperature) == greedy
    streamed = ["".join(c.text for c in tiny_llama.text_completion_stream(["Hello"], temperature, max_gen_len=4))]
    assert streamed == [r["generation"] for r in tiny_llama.text_completion(["Hello"], 0, max_gen_len=4)]
