"""Hugging Face folders: direct loading, conversion both ways, and clear errors on bad folders."""

import json
import shutil

import pytest
import torch
from helpers import TINY_PARAMS, import_or_skip, make_checkpoint

from llama import Llama
from llama.checkpoint import load_model, model_args_from, open_checkpoint
from llama.checkpoint.convert import meta_to_hf, read_full
from llama.cli.convert import main as convert_main
from llama.model import FeedForward

transformers = import_or_skip("transformers", 'pip install -e ".[test]"')

# Non-GQA (every query head has its own kv head) next to the GQA TINY_PARAMS.
MHA_PARAMS = dict(TINY_PARAMS, n_kv_heads=None, ffn_dim_multiplier=1.3, multiple_of=16)


@pytest.fixture(scope="module", params=["gqa", "mha"])
def folders(request, tmp_path_factory, tokenizer_path):
    """A Meta checkpoint, its Hugging Face conversion, and the Meta conversion of that (2 shards)."""
    root = tmp_path_factory.mktemp(request.param)
    meta = make_checkpoint(root / "meta", TINY_PARAMS if request.param == "gqa" else MHA_PARAMS, seed=3)
    shutil.copy(tokenizer_path, meta / "tokenizer.model")
    convert_main(["to-hf", str(meta), str(root / "hf")])
    convert_main(["to-meta", str(root / "hf"), str(root / "back"), "--model_parallel_size", "2"])
    return meta, root / "hf", root / "back"


def hf_model(folder) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def our_model(folder, max_seq_len=64):
    reader = open_checkpoint(folder)
    args, _ = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=2)
    return load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32)


def test_meta_hf_meta_round_trip_is_bit_identical(folders):
    meta, _, back = folders
    original, returned = open_checkpoint(meta), open_checkpoint(back)
    assert returned.format == "meta" and len(returned.files) == 2
    assert original.shapes.keys() == returned.shapes.keys()
    for key in original.shapes:
        a, b = read_full(original, key), read_full(returned, key)
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, b), key
    # params.json may pick other (multiple_of, ffn_dim_multiplier) values, but the model is the same.
    before, after = model_args_from(original.params)[0], model_args_from(returned.params)[0]
    width = [FeedForward.hidden_size(4 * a.dim, a.multiple_of, a.ffn_dim_multiplier) for a in (before, after)]
    assert width[0] == width[1]
    assert (before.n_kv_heads or before.n_heads) == after.n_kv_heads
    for field in ("dim", "n_layers", "n_heads", "vocab_size", "norm_eps", "rope_theta", "use_scaled_rope"):
        assert getattr(before, field) == getattr(after, field), field
    assert (back / "tokenizer.model").is_file()


def test_logits_match_transformers_on_the_hf_folder(folders, process_group):
    _, hf, _ = folders
    tokens = torch.randint(0, TINY_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(hf)(tokens).logits
    ours = our_model(hf)
    assert open_checkpoint(hf).format == "hf"
    assert (ours(tokens, 0) - expected).abs().max().item() < 1e-4


def test_greedy_tokens_match_transformers_generate(folders, process_group):
    _, hf, _ = folders
    generator = Llama.build(str(hf), max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32")
    assert generator.model.tok_embeddings.weight.dtype == torch.float32
    prompt = generator.tokenizer.encode("The capital of France is", bos=True, eos=False)
    ours, _ = generator.generate([prompt], max_gen_len=12, temperature=0)
    with torch.no_grad():
        theirs = hf_model(hf).generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours[0] == theirs[0, len(prompt) :].tolist()


def test_dtype_comes_from_the_hf_checkpoint_unless_asked(folders, tokenizer_path, process_group):
    _, hf, _ = folders
    generator = Llama.build(str(hf), tokenizer_path, max_seq_len=16, max_batch_size=1, device="cpu")
    assert generator.model.tok_embeddings.weight.dtype == torch.bfloat16


def test_tied_embeddings_use_the_embedding_as_output_head(tmp_path, process_group):
    params = dict(TINY_PARAMS, vocab_size=512)
    meta = make_checkpoint(tmp_path / "meta", params, seed=5)
    tensors = torch.load(meta / "consolidated.00.pth", weights_only=True)
    del tensors["output.weight"]
    shutil.rmtree(meta)
    from llama.checkpoint import write_meta_checkpoint

    write_meta_checkpoint(meta, params, tensors)
    convert_main(["to-hf", str(meta), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    tokens = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tmp_path / "hf")(tokens).logits
    for folder in (meta, tmp_path / "hf"):
        model = our_model(folder)
        assert torch.equal(model.output.weight, model.tok_embeddings.weight)
        assert (model(tokens, 0) - expected).abs().max().item() < 1e-4


def test_tokenizer_is_found_in_original_folder(folders, process_group):
    meta, hf, _ = folders
    (hf / "tokenizer.model").rename(hf / "tokenizer.moved")
    try:
        with pytest.raises(FileNotFoundError, match="original"):
            Llama.build(str(hf), max_seq_len=16, max_batch_size=1, device="cpu")
        (hf / "original").mkdir(exist_ok=True)
        shutil.copy(hf / "tokenizer.moved", hf / "original" / "tokenizer.model")
        generator = Llama.build(str(hf), max_seq_len=16, max_batch_size=1, device="cpu")
        assert generator.tokenizer.n_words == TINY_PARAMS["vocab_size"]
    finally:
        shutil.rmtree(hf / "original", ignore_errors=True)
        (hf / "tokenizer.moved").rename(hf / "tokenizer.model")


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_non_llama_config_is_refused(folders, tmp_path):
    hf = copy_folder(folders[1], tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*not a Llama model"):
        open_checkpoint(hf)


def test_missing_shard_names_file_and_key(folders, tmp_path):
    hf = copy_folder(folders[1], tmp_path / "hf")
    next(hf.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00001-of-00001\.safetensors.*model\."):
        open_checkpoint(hf)


def test_shape_mismatch_names_file_and_key(folders, tmp_path, process_group):
    hf = copy_folder(folders[1], tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] *= 2
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"w1\.weight in model-00001-of-00001\.safetensors \(model\.layers\.0\.mlp"):
        our_model(hf)


def test_unexpected_tensor_is_named(folders, tmp_path):
    from safetensors.torch import save_file

    hf = copy_folder(folders[1], tmp_path / "hf")
    (hf / "model.safetensors.index.json").unlink()
    save_file({"model.vision_tower.weight": torch.zeros(2)}, hf / "model-extra.safetensors")
    with pytest.raises(ValueError, match=r"model\.vision_tower\.weight \(in model-extra\.safetensors\)"):
        open_checkpoint(hf)


def test_interrupted_conversion_leaves_no_finished_looking_folder(folders, tmp_path, monkeypatch):
    meta = folders[0]

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_main(["to-meta", str(folders[1]), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileExistsError, match="not empty"):
        meta_to_hf(meta, meta)


def test_meta_checkpoint_with_rope_freqs_converts(tmp_path, process_group):
    """`rope.freqs`, a table some Meta checkpoints carry, is not a weight: conversion leaves it out."""
    from llama.checkpoint import random_weights, write_meta_checkpoint

    params = dict(TINY_PARAMS, vocab_size=512)
    tensors = dict(random_weights(params, seed=6), **{"rope.freqs": torch.ones(8)})
    write_meta_checkpoint(tmp_path / "meta", params, tensors)
    convert_main(["to-hf", str(tmp_path / "meta"), str(tmp_path / "hf")])
    hf_names = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(hf_names) == len(tensors) - 1 and not any("rope" in name for name in hf_names)
    tokens = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(tmp_path / "hf")(tokens).logits
    assert (our_model(tmp_path / "meta")(tokens, 0) - expected).abs().max().item() < 1e-4
