"""Llama 3.2 Vision against Meta's own code: llama-models' `CrossAttentionTransformer` and its `Llama3` generator,
on the same random checkpoint in Meta's layout, in float32, greedy. Each case is a chat the two must answer with
the same tokens and log-probabilities: images of every tile arrangement, tiny and grayscale images, text before
the image, two images, a later turn, and text only.

Meta's encoder sizes are fixed in its code; most cases use a small encoder (this library's `vision_encoder_*`
params fields, with Meta's classes built at the same sizes by the `small_encoder` patch), and one runs Meta's full
encoder (1,280 wide, 32 + 8 layers)."""

from pathlib import Path

import pytest
import torch
from helpers import VISION_PARAMS, make_checkpoint, png_bytes
from meta_vision import meta_multimodal

from llama import Llama

TEXT_PARAMS = {key: value for key, value in VISION_PARAMS.items() if not key.startswith("vision_encoder_")}
SMALL_ENCODER = {key: value for key, value in VISION_PARAMS.items() if key.startswith("vision_encoder_")}
MAX_SEQ_LEN = 128
MAX_BATCH_SIZE = 3
STEPS = 6  # greedy tokens compared per case
LOGPROB_TOLERANCE = 1e-3


def image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> dict:
    return {"type": "image", "image": png_bytes(width, height, mode, seed)}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


# (name, dialog): each dialog a list of (role, parts)
CASES = [
    ("one tile", [("user", [image(20, 20), text("What is this?")])]),
    ("two tiles wide", [("user", [image(60, 25, seed=1), text("Describe it.")])]),
    ("two tiles high", [("user", [image(25, 60, seed=2), text("Describe it.")])]),
    ("three tiles", [("user", [image(90, 28, seed=3), text("Describe it.")])]),
    ("four tiles", [("user", [image(300, 280, seed=4), text("Describe it.")])]),
    ("tiny", [("user", [image(1, 3, seed=5), text("What is this?")])]),
    ("grayscale", [("user", [image(40, 30, "L", seed=6), text("What is this?")])]),
    ("rgba", [("user", [image(40, 30, "RGBA", seed=7), text("What is this?")])]),
    ("text first", [("user", [text("Look at this picture:"), image(50, 50, seed=8), text("What is it?")])]),
    (
        "two images",
        [("user", [image(30, 30, seed=9), text("and"), image(60, 20, seed=10), text("Same?")])],
    ),
    (
        "two images together",
        [("user", [image(30, 30, seed=9), image(60, 20, seed=10), text("Same?")])],
    ),
    (
        "a later turn",
        [
            ("user", [image(50, 40, seed=11), text("What is this?")]),
            ("assistant", [text("A picture of noise.")]),
            ("user", [text("Are you sure?")]),
        ],
    ),
    ("text only", [("user", [text("What is the capital of France?")])]),
]


def our_llama(checkpoint: Path, tokenizer_path: str) -> Llama:
    return Llama.build(
        str(checkpoint),
        tokenizer_path,
        max_seq_len=MAX_SEQ_LEN,
        max_batch_size=MAX_BATCH_SIZE,
        device="cpu",
        dtype="float32",
    )


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vision") / "small", VISION_PARAMS, seed=3)


def small_encoder(monkeypatch, multimodal) -> None:
    """Build Meta's vision classes at SMALL_ENCODER's sizes (its code fixes Meta's own)."""
    encoder_init, vision_init = multimodal.VisionEncoder.__init__, multimodal.CrossAttentionTransformerVision.__init__
    width = SMALL_ENCODER["vision_encoder_width"]
    layers = SMALL_ENCODER["vision_encoder_intermediate_layers"]

    def encoder(self, *args, **kwargs):
        kwargs.update(
            width=width,
            layers=SMALL_ENCODER["vision_encoder_layers"],
            heads=SMALL_ENCODER["vision_encoder_heads"],
            n_global_layers=SMALL_ENCODER["vision_encoder_global_layers"],
            return_intermediate=layers,
        )
        encoder_init(self, *args, **kwargs)

    def vision(self, args):
        vision_init(self, args)
        self.vision_input_dim = width * (len(layers) + 1)
        self.vision_projection = multimodal.ColumnParallelLinear(
            self.vision_input_dim, args.dim, bias=True, init_method=lambda x: x
        )

    monkeypatch.setattr(multimodal.VisionEncoder, "__init__", encoder)
    monkeypatch.setattr(multimodal.CrossAttentionTransformerVision, "__init__", vision)


def meta_generator(checkpoint: Path, params: dict):
    """llama-models' `Llama3` on the checkpoint, in float32 on the CPU (built as its `Llama3.build` builds it, without
    the bfloat16 default tensor type that its checkpoint reader sets)."""
    multimodal = meta_multimodal()
    from llama_models.llama3.args import ModelArgs
    from llama_models.llama3.generation import Llama3
    from llama_models.llama3.tokenizer import Tokenizer

    args = ModelArgs(max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH_SIZE, **params)
    model = multimodal.CrossAttentionTransformer(args)
    state_dict = torch.load(checkpoint / "consolidated.00.pth", map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    model.setup_cache(MAX_BATCH_SIZE, device=torch.device("cpu"), dtype=torch.float32)
    return Llama3(model.eval(), Tokenizer.get_instance(), args)


def meta_content(parts: list) -> list:
    from llama_models.datatypes import RawMediaItem, RawTextItem

    return [RawTextItem(text=p["text"]) if p["type"] == "text" else RawMediaItem(data=p["image"]) for p in parts]


def meta_results(steps, batch_size: int, stop_tokens) -> list:
    """Per prompt, Meta's generated tokens, before a stop token, and their log-probabilities, from the results its
    generator yields step by step."""
    answers = [([], []) for _ in range(batch_size)]
    stopped = [False] * batch_size
    for results in steps:
        for result in results:
            index = result.batch_idx
            if result.ignore_token or stopped[index]:
                continue
            if result.token in stop_tokens:
                stopped[index] = True
                continue
            answers[index][0].append(result.token)
            answers[index][1].append(result.logprobs[0])
    return answers


def meta_answer(generator, dialog, stop_tokens) -> tuple:
    """Meta's greedy tokens, up to STEPS and before a stop token, and their log-probabilities."""
    return meta_answers(generator, [dialog], stop_tokens)[0]


def meta_answers(generator, dialogs, stop_tokens) -> list:
    from llama_models.datatypes import RawMessage

    batch = [[RawMessage(role=role, content=meta_content(parts)) for role, parts in dialog] for dialog in dialogs]
    steps = generator.chat_completion(batch, temperature=0, max_gen_len=STEPS, logprobs=True)
    return meta_results(steps, len(dialogs), stop_tokens)


def our_answer(llama: Llama, dialog) -> tuple:
    dialog = [{"role": role, "content": parts} for role, parts in dialog]
    answer = llama.chat_completion([dialog], temperature=0, max_gen_len=STEPS, logprobs=True)[0]
    return answer["tokens"], answer["logprobs"]


def compare(llama: Llama, meta, dialog) -> float:
    """Assert the same greedy tokens; return the largest log-probability difference."""
    meta_tokens, meta_logprobs = meta_answer(meta, dialog, llama.tokenizer.stop_tokens)
    tokens, logprobs = our_answer(llama, dialog)
    assert tokens == [llama.tokenizer.decode([t]) for t in meta_tokens]
    assert len(tokens) > 0
    return max(abs(a - b) for a, b in zip(logprobs, meta_logprobs))


@pytest.fixture(scope="module")
def small_pair(small_checkpoint, tokenizer_path, process_group):
    llama = our_llama(small_checkpoint, tokenizer_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        small_encoder(monkeypatch, meta_multimodal())
        meta = meta_generator(small_checkpoint, {**TEXT_PARAMS})
    return llama, meta


@pytest.mark.parametrize("name, dialog", CASES, ids=[name for name, _ in CASES])
def test_answers_as_metas_code_does(small_pair, name, dialog):
    llama, meta = small_pair
    assert compare(llama, meta, dialog) < LOGPROB_TOLERANCE


@pytest.mark.slow
def test_metas_full_size_encoder_gives_the_same_answers(tmp_path, tokenizer_path, process_group):
    checkpoint = make_checkpoint(tmp_path / "full", TEXT_PARAMS, seed=3)
    llama = our_llama(checkpoint, tokenizer_path)
    meta = meta_generator(checkpoint, TEXT_PARAMS)
    for name, dialog in CASES:
        if name in ("four tiles", "text first", "two images"):
            assert compare(llama, meta, dialog) < LOGPROB_TOLERANCE, name


def test_a_batch_answers_as_metas_code_does(small_pair):
    """One image, text only and two images in one batch: Meta's code runs the text-only row through the
    cross-attention too, with every position masked (its output dropped), as ours does."""
    llama, meta = small_pair
    named = dict(CASES)
    dialogs = [named["one tile"], named["text only"], named["two images"]]
    expected = meta_answers(meta, dialogs, llama.tokenizer.stop_tokens)
    answers = llama.chat_completion(
        [[{"role": role, "content": parts} for role, parts in dialog] for dialog in dialogs],
        temperature=0,
        max_gen_len=STEPS,
        logprobs=True,
    )
    for answer, (tokens, logprobs) in zip(answers, expected):
        # llama-models decodes every row up to the longest prompt plus max_gen_len; Meta's llama3 API, ours, cuts
        # each row at its own prompt plus max_gen_len.
        tokens = tokens[:STEPS]
        assert answer["tokens"] == [llama.tokenizer.decode([t]) for t in tokens]
        assert max(abs(a - b) for a, b in zip(answer["logprobs"], logprobs)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("first", ["image", "text"])
def test_completes_text_and_image_parts_as_metas_code_does(small_pair, first):
    """`text_completion` of a list of parts: Meta's `completion` of the same content (<|begin_of_text|>, then the
    parts in order)."""
    llama, meta = small_pair
    parts = [image(40, 40, seed=12), text("A photo of")]
    parts = parts if first == "image" else parts[::-1]
    steps = meta.completion([meta_content(parts)], temperature=0, max_gen_len=STEPS, logprobs=True)
    [(tokens, logprobs)] = meta_results(steps, 1, llama.tokenizer.stop_tokens)
    [answer] = llama.text_completion([parts], temperature=0, max_gen_len=STEPS, logprobs=True)
    assert answer["tokens"] == [llama.tokenizer.decode([t]) for t in tokens]
    assert max(abs(a - b) for a, b in zip(answer["logprobs"], logprobs)) < LOGPROB_TOLERANCE
