"""Llama 3.2 Vision in Hugging Face's Mllama layout (transformers' MllamaForConditionalGeneration), both ways: a tiny
random checkpoint in Meta's layout converted to an HF folder (`llama convert to-hf`) and back, `Llama.build` on
either, and transformers itself on the folder written, all in float32.

The checkpoint is `helpers.VISION_PARAMS`: 4 text layers with 2 cross-attention blocks (HF numbers its 6 layers with
the blocks at 1 and 4), tiles of 28 pixels, a small encoder (32 wide, 4 + 2 layers, intermediate layers 0, 2, 3), and
every gate nonzero, so that each mapped tensor changes what the model computes."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import VISION_PARAMS, make_checkpoint, png_bytes

from llama import Llama
from llama.checkpoint.convert import hf_to_meta
from llama.checkpoint.hf_mllama_config import aspect_ratios, mllama_config, mllama_config_to_params
from llama.cli.convert import main as convert
from llama.text import dialog_images, encode_dialogs
from llama.vision.batch import show_images
from llama.vision.encoder import MAX_TILES
from llama.vision.images import image_tiles, open_image
from llama.vision.model import ENCODER_FIELDS, IMAGE_TOKEN_ID, VISION_FIELDS

MAX_SEQ_LEN = 64
STEPS = 6
HF_IMAGE_TOKEN_ID = 128256  # HF's <|image|>: the first row after the vocabulary, learnable_embedding's first
TILE_SIZE = VISION_PARAMS["vision_chunk_size"]
TILE_EMBEDDINGS = [
    "vision_model.vision_encoder.pre_tile_pos_embed.embedding",
    "vision_model.vision_encoder.post_tile_pos_embed.embedding",
    "vision_model.vision_encoder.gated_positional_embedding",
]
# Tile positions (row, column) some grid of at most 4 tiles uses; HF's per-aspect-ratio rows hold only these.
REACHABLE = torch.zeros(MAX_TILES, MAX_TILES, dtype=torch.bool)
for _high, _wide in aspect_ratios():
    REACHABLE[:_high, :_wide] = True
# An image of each grid (tiles high x wide) at 28-pixel tiles: every aspect ratio HF stores.
IMAGES = {
    "1x1": (20, 20),
    "1x2": (56, 28),
    "1x3": (60, 25),
    "1x4": (90, 28),
    "2x1": (28, 56),
    "2x2": (300, 280),
    "3x1": (25, 60),
    "4x1": (28, 112),
}


def dialog(image: bytes) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


def build(folder: Path, tokenizer_path: str) -> Llama:
    return Llama.build(str(folder), tokenizer_path, MAX_SEQ_LEN, max_batch_size=1, device="cpu", dtype="float32")


def answer(llama: Llama, image: bytes) -> tuple:
    [result] = llama.chat_completion([dialog(image)], temperature=0, max_gen_len=STEPS, logprobs=True)
    return result["tokens"], result["logprobs"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The Meta checkpoint and the HF folder `llama convert to-hf` writes for it."""
    root = tmp_path_factory.mktemp("vision_hf")
    make_checkpoint(root / "meta", VISION_PARAMS, seed=3)
    convert(["to-hf", str(root / "meta"), str(root / "hf")])
    return root / "meta", root / "hf"


@pytest.fixture(scope="module")
def hf_llama(folders, tokenizer_path, process_group) -> Llama:
    return build(folders[1], tokenizer_path)


@pytest.fixture(scope="module")
def hf_model(folders):
    """transformers' own model on the HF folder, and what its loading reported."""
    transformers = pytest.importorskip("transformers")
    model, info = transformers.MllamaForConditionalGeneration.from_pretrained(
        folders[1], attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def test_meta_to_hf_and_back_gives_the_same_tensors(folders, tmp_path):
    meta, hf = folders
    hf_to_meta(hf, tmp_path / "back")
    original = torch.load(meta / "consolidated.00.pth", weights_only=True)
    back = torch.load(tmp_path / "back" / "consolidated.00.pth", weights_only=True)
    assert list(back) == list(original)
    for key, tensor in original.items():
        if key in TILE_EMBEDDINGS:  # positions no image reaches, such as (1, 2), have no place in HF's layout
            assert tensor[~REACHABLE].any()
            tensor = tensor.clone()
            tensor[~REACHABLE] = 0
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    params = json.loads((tmp_path / "back" / "params.json").read_text())
    fields = [*VISION_FIELDS, *ENCODER_FIELDS, "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"]
    assert {name: params[name] for name in fields} == {name: VISION_PARAMS[name] for name in fields}


def test_the_hf_folder_answers_as_the_meta_checkpoint(folders, hf_llama, tokenizer_path, process_group):
    image = png_bytes(60, 25, seed=1)
    tokens, logprobs = answer(hf_llama, image)
    assert len(tokens) > 0
    assert (tokens, logprobs) == answer(build(folders[0], tokenizer_path), image)


def test_a_two_shard_meta_checkpoint_from_the_hf_folder_answers_the_same(folders, hf_llama, tmp_path, tokenizer_path):
    hf_to_meta(folders[1], tmp_path / "mp2", model_parallel_size=2)
    assert sorted(p.name for p in (tmp_path / "mp2").glob("*.pth")) == ["consolidated.00.pth", "consolidated.01.pth"]
    image = png_bytes(25, 60, seed=2)
    assert answer(build(tmp_path / "mp2", tokenizer_path), image) == answer(hf_llama, image)


def test_transformers_loads_every_tensor_of_the_folder(hf_model):
    _, info = hf_model
    assert {name: list(info[name]) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }


@pytest.fixture(scope="module")
def image_processor():
    """transformers' image processor as its converter sets it up for Llama 3.2 Vision (at our tile size)."""
    from transformers import MllamaImageProcessorPil

    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    return MllamaImageProcessorPil(
        size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES, image_mean=mean, image_std=std
    )


@pytest.fixture
def encoder_keeping_layer_inputs(monkeypatch):
    """transformers' Mllama encoder, collecting each layer's input as its intermediate features, as Meta's code and
    transformers 4 do: transformers 5.23's `MllamaVisionEncoder` collects each layer's output instead, so that
    `intermediate_layers_indices` pick features one layer late (docs/vision.md). Everything else is transformers'."""
    from transformers.modeling_outputs import BaseModelOutput
    from transformers.models.mllama import modeling_mllama

    def forward(self, hidden_states, attention_mask=None):
        inputs = []
        for layer in self.layers:
            inputs.append(hidden_states)
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=(*inputs, hidden_states))

    monkeypatch.setattr(modeling_mllama.MllamaVisionEncoder, "forward", forward)


@pytest.mark.parametrize("size", IMAGES.values(), ids=IMAGES)
def test_transformers_computes_the_same_logits(hf_llama, hf_model, image_processor, encoder_keeping_layer_inputs, size):
    """The chat prompt from its image on, every position, with the inputs transformers' processor makes (its image
    token, 128256, where our prompt holds <|image|>). From the image on: transformers lets the positions before a
    prompt's first image attend to it, where Meta's code drops their cross-attention output (transformers issue
    #39379), which changes them and, through the self-attention, every position after them."""
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    model, _ = hf_model
    image = png_bytes(*size, seed=4)
    [chat] = encode_dialogs(hf_llama.formatter, [dialog(image)])
    tokens = chat[chat.index(IMAGE_TOKEN_ID) :]
    assert len(tokens) >= 8  # <|image|>What is it?<|eot_id|> and the assistant's header
    show_images(hf_llama.model, [tokens], dialog_images([dialog(image)]))
    ours = hf_llama.model.text_model.forward(torch.tensor([tokens]), 0)[0]
    show_images(hf_llama.model, [tokens], [[]])

    inputs = image_processor(images=[[open_image(image)]], return_tensors="pt")
    tiles, (high, wide) = image_tiles(open_image(image), TILE_SIZE, MAX_TILES)  # what our model was given
    assert torch.equal(inputs["pixel_values"][0, 0, : high * wide], tiles)
    assert model.config.vision_config.supported_aspect_ratios[inputs["aspect_ratio_ids"].item() - 1] == [high, wide]
    input_ids = [HF_IMAGE_TOKEN_ID if token == IMAGE_TOKEN_ID else token for token in tokens]
    spans = get_cross_attention_token_mask(input_ids, HF_IMAGE_TOKEN_ID)
    mask = convert_sparse_cross_attention_mask_to_dense([spans], inputs.pop("num_tiles"), MAX_TILES, len(tokens))
    with torch.no_grad():
        theirs = model(
            input_ids=torch.tensor([input_ids]), cross_attention_mask=torch.from_numpy(mask), use_cache=False, **inputs
        ).logits[0]
    assert (ours - theirs).abs().max() < 1e-4


@pytest.mark.parametrize("names", ["save_pretrained", "state_dict"])
def test_a_folder_saved_by_transformers_gives_the_same_model(hf_model, hf_llama, tmp_path, tokenizer_path, names):
    """transformers 5 writes its own config.json (rope_parameters, dtype...) and, with save_pretrained, the released
    checkpoints' tensor names; its model's state_dict has others (`model.language_model.*`, `lm_head.*`)."""
    from safetensors.torch import save_file

    model, _ = hf_model
    model.save_pretrained(tmp_path / "saved")
    if names == "state_dict":
        (tmp_path / "saved" / "model.safetensors").unlink()
        save_file(model.state_dict(), tmp_path / "saved" / "model.safetensors", metadata={"format": "pt"})
    saved = build(tmp_path / "saved", tokenizer_path)
    expected = hf_llama.model.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in saved.model.state_dict().items())
    image = png_bytes(90, 28, seed=5)
    (tokens, logprobs), (expected_tokens, expected_logprobs) = answer(saved, image), answer(hf_llama, image)
    assert tokens == expected_tokens  # the log-probabilities differ by float rounding: float32 files map unaligned
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < 1e-5


def test_metas_encoder_sizes_write_no_fields_of_this_library():
    """Meta's code reads no `vision_encoder_*` field: the params.json read from an HF config of Meta's encoder (1,280
    wide, 32 + 8 layers) has none, and one for another encoder has those of its sizes that are not Meta's."""
    text_params = {key: value for key, value in VISION_PARAMS.items() if not key.startswith("vision_encoder_")}
    config = mllama_config(text_params, torch.bfloat16)
    assert config["vision_config"]["hidden_size"] == 1280 and config["vision_config"]["vision_output_dim"] == 7680
    params = mllama_config_to_params(config, "config.json")
    assert [key for key in params if key.startswith("vision_")] == list(VISION_FIELDS)
    assert {key: params[key] for key in VISION_FIELDS} == {key: VISION_PARAMS[key] for key in VISION_FIELDS}
    deeper = mllama_config_to_params(mllama_config({**text_params, "vision_encoder_layers": 34}, torch.bfloat16), "c")
    assert [key for key in deeper if key.startswith("vision_")] == [*VISION_FIELDS, "vision_encoder_layers"]
    assert deeper["vision_encoder_layers"] == 34


def test_tile_embeddings_that_differ_between_aspect_ratios_are_refused(
    folders, tmp_path, tokenizer_path, process_group
):
    """A model trained in HF's layout may give one tile position different embeddings in different aspect ratios'
    rows; Meta's layout has one, so loading it would change the model: it is refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "edited"
    shutil.copytree(folders[1], folder)
    [path] = folder.glob("model-*.safetensors")
    tensors = load_file(path)
    name = "vision_model.pre_tile_positional_embedding.embedding.weight"
    tensors[name][aspect_ratios().index((1, 2)) + 1, :8] += 1  # the first tile of a 1x2 grid, not of a 1x1 one
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{name}.*aspect ratio 2 \\(1x2 tiles\\)"):
        build(folder, tokenizer_path)
