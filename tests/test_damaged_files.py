"""Files that are damaged, mistyped or misplaced: each a ValueError or FileNotFoundError that names the file (and
the field or entry) and says what to do, never a raw error from torch, safetensors or json. And the files we
write: each shard holds exactly its share, with the usual permissions."""

import json
import os
import shutil

import pytest
import torch
from helpers import TINY_PARAMS, make_checkpoint

from llama import Llama
from llama.checkpoint import open_checkpoint
from llama.convert import main as convert_main


@pytest.fixture(scope="module")
def hf_folder(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint converted to a Hugging Face folder (one safetensors file, with an index)."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    convert_main(["to-hf", str(tiny_checkpoint), str(out)])
    return out


def copy_of(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


def build(ckpt_dir, tokenizer_path, **kwargs):
    kwargs = {"max_seq_len": 32, "max_batch_size": 1, "device": "cpu", **kwargs}
    return Llama.build(str(ckpt_dir), tokenizer_path, **kwargs)


# What we write --------------------------------------------------------------------------------------------------


def test_each_shard_holds_its_share_only(hf_folder, tmp_path):
    """A shard saved as a view of a larger tensor would hold that whole tensor's bytes."""
    convert_main(["to-meta", str(hf_folder), str(tmp_path / "one")])
    convert_main(["to-meta", str(hf_folder), str(tmp_path / "two"), "--model_parallel_size", "2"])
    make_checkpoint(tmp_path / "written", n_shards=2)
    whole = (tmp_path / "one" / "consolidated.00.pth").stat().st_size
    for folder in ("two", "written"):
        for shard in sorted((tmp_path / folder).glob("consolidated.*.pth")):
            # Norms are replicated (a few KB); everything else is split in two. Allow 1% for the file format.
            assert shard.stat().st_size <= 0.51 * whole, shard


def test_written_files_get_the_usual_permissions(hf_folder):
    modes = {path.name: path.stat().st_mode & 0o777 for path in hf_folder.iterdir()}
    assert len(set(modes.values())) == 1, modes  # safetensors files as readable as config.json
    assert modes["config.json"] == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Damaged weights ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: b"not a checkpoint\n", id="text"),
    ],
)
def test_a_damaged_pth_file_is_named(tiny_checkpoint, tmp_path, damage):
    folder = copy_of(tiny_checkpoint, tmp_path)
    shard = folder / "consolidated.00.pth"
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(ValueError, match=r"consolidated\.00\.pth is not a readable PyTorch checkpoint.*Download it"):
        open_checkpoint(folder)


def test_a_truncated_safetensors_file_is_named(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    weights = next(folder.glob("model-*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{weights.name} is not a readable safetensors file.*Download it again"):
        open_checkpoint(folder)


# Configuration files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, field",
    [
        ({"dim": "128"}, "dim"),
        ({"n_layers": "two"}, "n_layers"),
        ({"norm_eps": "1e-5"}, "norm_eps"),
        ({"n_heads": None}, "n_heads"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"vocab_size": 128256.0}, "vocab_size"),
        ({"use_scaled_rope": "yes"}, "use_scaled_rope"),
    ],
)
def test_a_bad_params_json_value_names_file_and_field(tiny_checkpoint, tmp_path, change, field):
    folder = copy_of(tiny_checkpoint, tmp_path)
    (folder / "params.json").write_text(json.dumps({**TINY_PARAMS, **change}))
    with pytest.raises(ValueError, match=rf"params\.json: {field} must be"):
        open_checkpoint(folder)


def test_params_json_that_is_not_an_object(tiny_checkpoint, tmp_path):
    folder = copy_of(tiny_checkpoint, tmp_path)
    (folder / "params.json").write_text(json.dumps([TINY_PARAMS]))
    with pytest.raises(ValueError, match=r"params\.json must hold a JSON object, not a JSON list"):
        open_checkpoint(folder)


def test_params_json_without_a_required_field(tiny_checkpoint, tmp_path):
    folder = copy_of(tiny_checkpoint, tmp_path)
    (folder / "params.json").write_text(json.dumps({k: v for k, v in TINY_PARAMS.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match=r"params\.json lacks vocab_size"):
        open_checkpoint(folder)


def test_a_bad_config_json_value_names_file_and_field(hf_folder, tmp_path):
    folder = copy_of(hf_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    with pytest.raises(ValueError, match=r"config\.json: hidden_size must be a positive integer, got '64'"):
        open_checkpoint(folder)


def test_params_json_is_read_through_blobfile(tiny_checkpoint, monkeypatch):
    import llama.checkpoint

    read = []
    real = llama.checkpoint.blobfile.read_text
    monkeypatch.setattr(llama.checkpoint.blobfile, "read_text", lambda path: read.append(path) or real(path))
    assert open_checkpoint(tiny_checkpoint).params == TINY_PARAMS
    assert read == [str(tiny_checkpoint / "params.json")]


# Paths ----------------------------------------------------------------------------------------------------------


def test_a_checkpoint_path_that_is_a_file(tiny_checkpoint, tokenizer_path, process_group):
    with pytest.raises(ValueError, match=r"consolidated\.00\.pth is a file; pass the folder that holds it"):
        build(tiny_checkpoint / "consolidated.00.pth", tokenizer_path)


def test_a_tokenizer_path_that_is_a_folder(tiny_checkpoint, process_group):
    with pytest.raises(ValueError, match=r"is a folder; pass the tokenizer\.model file inside it"):
        build(tiny_checkpoint, str(tiny_checkpoint))


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/tmp/outside.safetensors", "linked/model.safetensors"])
def test_an_index_cannot_reach_outside_the_folder(hf_folder, tmp_path, entry):
    folder = copy_of(hf_folder, tmp_path)
    weights = next(folder.glob("model-*.safetensors"))
    shutil.copy(weights, tmp_path / "outside.safetensors")
    (folder / "linked").symlink_to(tmp_path, target_is_directory=True)  # a subfolder that leads out
    shutil.copy(weights, tmp_path / "model.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = entry
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"entry '{key}' points at {entry}, outside the checkpoint folder"):
        open_checkpoint(folder)


def test_linked_files_as_in_the_hugging_face_cache_load(hf_folder, tmp_path):
    """huggingface_hub's cache links each file of a snapshot folder to a blob elsewhere."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for path in hf_folder.iterdir():
        shutil.copy(path, blobs / path.name)
        (snapshot / path.name).symlink_to(blobs / path.name)
    assert open_checkpoint(snapshot).shapes == open_checkpoint(hf_folder).shapes


# Memory ---------------------------------------------------------------------------------------------------------


def test_a_kv_cache_that_cannot_fit_is_refused_before_allocating(tiny_checkpoint, tokenizer_path, process_group):
    # 2 layers x 2 (keys, values) x 1e6 sequences x 8192 positions x 2 kv heads x 16 dims x 4 bytes: 3.9 TiB.
    with pytest.raises(ValueError, match=r"KV cache .* needs 3906\.2 GiB on cpu, which has [\d.]+ GiB free; lower "
                       r"max_batch_size or max_seq_len"):  # fmt: skip
        build(tiny_checkpoint, tokenizer_path, max_seq_len=8192, max_batch_size=1_000_000)
    assert torch.zeros(1).item() == 0  # the process goes on
