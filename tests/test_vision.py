"""Llama 3.2 Vision through the API, beyond what Meta's code checks (tests/test_vision_meta.py): bad images and
misuse get a ValueError that says what to change, the chat format places <|image|> as llama-models' does, streams
give the calls' text, a call without images after one with them is a text-only call, and model parallelism over
two processes gives one process's answers."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import VISION_PARAMS, png_bytes, with_repo
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from llama import Llama

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("vision_worker.py")
STEPS = 6


def dialog_with(*parts) -> list:
    return [{"role": "user", "content": list(parts)}]


def image(data) -> dict:
    return {"type": "image", "image": data}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory) -> Path:
    from helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("vision") / "ckpt", VISION_PARAMS, seed=3)


@pytest.fixture(scope="module")
def vision_llama(vision_checkpoint, tokenizer_path, process_group) -> Llama:
    return Llama.build(
        str(vision_checkpoint), tokenizer_path, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32"
    )


def greedy(llama: Llama, dialog) -> dict:
    return llama.chat_completion([dialog], temperature=0, max_gen_len=STEPS, logprobs=True)[0]


def next_token_logprobs(llama: Llama, tokens: list, image_data: bytes) -> torch.Tensor:
    """The log-probabilities of the token after `tokens` (a prompt with one <|image|>, `image_data`)."""
    from llama.vision.batch import show_images

    show_images(llama.model, [tokens], [[image_data]])
    logits = llama.model.text_model.forward(torch.tensor([tokens]), 0)[0, -1]
    show_images(llama.model, [tokens], [])
    return torch.log_softmax(logits.float(), dim=-1)


def test_the_runtime_gives_the_reference_text_model_s_logits(vision_checkpoint, vision_llama, tokenizer_path):
    """The text model as Meta's code runs it (`TextModel.forward`, a batch's images padded to the most images a
    prompt has) against the runtime's (`RuntimeVisionText`, each row's own images, cross-attention only where a row
    sees one): a batch of a one-image prompt and a two-image one, then decode steps, in float32."""
    from datetime import timedelta

    from llama.checkpoint import load_checkpoint
    from llama.vision.batch import show_images

    reference, tokenizer, _ = load_checkpoint(
        str(vision_checkpoint), tokenizer_path, 128, 2, None, 1, "cpu", "float32", None, timedelta(seconds=60)
    )
    dialogs = [
        dialog_with(text("Look at this one."), image(png_bytes(40, 30, seed=1)), text("What is it?")),
        dialog_with(image(png_bytes(30, 60, seed=2)), image(png_bytes(50, 50, seed=3)), text("Which is red?")),
    ]
    prompts = [vision_llama.formatter.encode_dialog_prompt(dialog) for dialog in dialogs]
    length = min(len(prompt) for prompt in prompts)
    tokens = torch.tensor([prompt[:length] for prompt in prompts])
    images = [[part["image"] for part in dialog[0]["content"] if part["type"] == "image"] for dialog in dialogs]
    runtime = vision_llama.model
    for model in (reference, runtime):
        show_images(model, prompts, images)
    try:
        logits = [model.text_model.forward(tokens, 0) for model in (reference, runtime)]
        for step in range(3):
            torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)
            token = logits[0][:, -1:].argmax(dim=-1)
            logits = [model.text_model.forward(token, length + step) for model in (reference, runtime)]
    finally:
        for model in (reference, runtime):
            show_images(model, prompts, [])


def test_the_load_report_names_a_vision_model(vision_llama, tiny_llama):
    assert "vision model" in str(vision_llama.load_report)
    assert "vision" not in str(tiny_llama.load_report)


def test_a_text_model_given_an_image_says_so(tiny_checkpoint, tokenizer_path, process_group):
    for version, message in (("3.1", "takes no images"), ("3", "Images need a Llama 3.2 Vision model")):
        llama = Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=64, device="cpu", version=version)
        with pytest.raises(ValueError, match=message):
            llama.chat_completion([dialog_with(image(png_bytes(8, 8)), text("Hi"))], max_gen_len=2)
        with pytest.raises(ValueError, match=message):
            llama.text_completion([[image(png_bytes(8, 8)), text("Hi")]], max_gen_len=2)


def test_the_image_shapes_a_user_gives_give_one_answer(vision_llama, tmp_path):
    """A PIL image, the file's bytes and its path (str or Path) are the same image."""
    data = png_bytes(40, 30, seed=1)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    answers = [
        greedy(vision_llama, dialog_with(image(source), text("What is it?")))
        for source in (data, Image.open(io.BytesIO(data)), str(path), path)
    ]
    assert all(answer == answers[0] for answer in answers[1:])


def test_the_image_changes_the_answer(vision_llama):
    """The cross-attention reads the image: two images give two answers (random weights, nonzero gates)."""
    first = greedy(vision_llama, dialog_with(image(png_bytes(40, 30, seed=1)), text("What is it?")))
    second = greedy(vision_llama, dialog_with(image(png_bytes(40, 30, seed=2)), text("What is it?")))
    assert first["logprobs"] != second["logprobs"]


def test_a_call_without_images_after_one_with_them_sees_none(vision_llama, vision_checkpoint, tokenizer_path):
    dialog = dialog_with(text("What is the capital of France?"))
    fresh = Llama.build(
        str(vision_checkpoint), tokenizer_path, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32"
    )
    expected = greedy(fresh, dialog)
    greedy(vision_llama, dialog_with(image(png_bytes(40, 30)), text("What is it?")))
    assert greedy(vision_llama, dialog) == expected
    tokens = vision_llama.formatter.encode_dialog_prompt(dialog)
    assert vision_llama.generate([tokens], STEPS, temperature=0)[0][0] == fresh.generate([tokens], STEPS, 0)[0][0]


def test_streams_give_the_calls_text(vision_llama):
    dialog = dialog_with(image(png_bytes(60, 25, seed=4)), text("Describe it."))
    answer = vision_llama.chat_completion([dialog], temperature=0, max_gen_len=STEPS)[0]
    chunks = vision_llama.chat_completion_stream([dialog], temperature=0, max_gen_len=STEPS)
    assert "".join(chunk.text for chunk in chunks) == answer["generation"]["content"]
    prompt = [image(png_bytes(60, 25, seed=4)), text("A photo of")]
    completion = vision_llama.text_completion([prompt], temperature=0, max_gen_len=STEPS)[0]["generation"]
    chunks = vision_llama.text_completion_stream([prompt], temperature=0, max_gen_len=STEPS)
    assert "".join(chunk.text for chunk in chunks) == completion


def test_the_chat_format_places_images_as_llama_models_does(vision_llama):
    """Token for token llama-models' `ChatFormat.encode_dialog_prompt`, whose model input holds 128256 where the
    prompt has <|image|> (128011; our model maps it to the same embedding row)."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    data = png_bytes(8, 8)
    dialog = [
        {"role": "system", "content": [text("Be brief.")]},
        {"role": "user", "content": [text(" Look: "), image(data), image(data), text("and this "), image(data)]},
        {"role": "assistant", "content": [text("Three pictures.")]},
        {"role": "user", "content": [image(data), text("Again?")]},
    ]
    meta_dialog = [
        RawMessage(
            role=m["role"],
            content=[
                RawTextItem(text=p["text"]) if p["type"] == "text" else RawMediaItem(data=data) for p in m["content"]
            ],
        )
        for m in dialog
    ]
    expected = ChatFormat(Tokenizer.get_instance()).encode_dialog_prompt(meta_dialog).tokens
    ours = vision_llama.formatter.encode_dialog_prompt(dialog)
    assert [128256 if token == 128011 else token for token in ours] == expected


@pytest.mark.parametrize(
    "source, message",
    [
        (b"not an image at all", "not an image file"),
        (png_bytes(40, 30)[:60], "truncated|damaged"),
        (b"", "not an image file"),
        (42, "takes a PIL image"),
        ("/no/such/picture.png", "No image file"),
    ],
    ids=["not an image", "truncated", "empty", "a number", "a missing path"],
)
def test_a_bad_image_gets_an_error_that_names_it(vision_llama, source, message):
    error = FileNotFoundError if isinstance(source, str) else ValueError
    with pytest.raises(error, match=message):
        vision_llama.chat_completion([dialog_with(image(source), text("What is it?"))], max_gen_len=2)


def test_more_images_than_a_prompt_may_hold_are_refused(vision_llama):
    parts = [image(png_bytes(8, 8, seed=i)) for i in range(5)] + [text("Which is red?")]
    with pytest.raises(ValueError, match="at most 4"):
        vision_llama.chat_completion([dialog_with(*parts)], max_gen_len=2)


def test_a_malformed_part_is_named(vision_llama):
    with pytest.raises(ValueError, match="Content part 1 must be"):
        vision_llama.chat_completion([dialog_with(text("Hi"), {"type": "image_url", "url": "x"})], max_gen_len=2)
    with pytest.raises(ValueError, match="Prompt 0: Content part 0 must be"):
        vision_llama.text_completion([[{"type": "image"}]], max_gen_len=2)


@pytest.mark.parametrize("option", ["draft", "compile"])
def test_options_a_vision_model_does_not_have_are_refused(
    vision_checkpoint, tiny_checkpoint, tokenizer_path, process_group, option
):
    options = {"draft": str(tiny_checkpoint)} if option == "draft" else {"compile": True}
    with pytest.raises(ValueError, match="not available with a Llama 3.2 Vision model"):
        Llama.build(str(vision_checkpoint), tokenizer_path, max_seq_len=64, device="cpu", **options)


def test_the_prefix_cache_and_prompt_lookup_keep_the_answers_and_reuse_nothing_an_image_sees(
    vision_checkpoint, vision_llama, tokenizer_path, process_group
):
    """A conversation's turns with the prefix cache and prompt lookup on: each answer (tokens, logprobs) is the one a
    cold call gives, and the tokens reused stop before the first <|image|>: those after it saw the image."""
    cached = Llama.build(
        str(vision_checkpoint),
        tokenizer_path,
        max_seq_len=160,
        max_batch_size=2,
        device="cpu",
        dtype="float32",
        prefix_cache=True,
        draft="lookup",
    )
    system = {"role": "system", "content": "You describe pictures in a few words, plainly and briefly."}
    dialog = [system, *dialog_with(text("Look:"), image(png_bytes(40, 30)), text("What is it? What is it?"))]
    image_token = cached.tokenizer.special_tokens["<|image|>"]
    proposed = 0
    for turn in range(3):
        answer = greedy(cached, dialog)  # with logprobs: no speculation
        cold = greedy(vision_llama, dialog)
        assert answer["tokens"] == cold["tokens"]
        assert answer["logprobs"] == pytest.approx(cold["logprobs"], abs=1e-4)
        reused = cached.decoder.last_reused[0]
        assert reused <= cached.formatter.encode_dialog_prompt(dialog).index(image_token)
        assert reused > 0 if turn else reused == 0  # the system prompt, run once
        guessed = cached.chat_completion([dialog], temperature=0, max_gen_len=12)[0]["generation"]
        assert guessed == vision_llama.chat_completion([dialog], temperature=0, max_gen_len=12)[0]["generation"]
        proposed += cached.decoder.last_drafts.proposed
        dialog = dialog + [answer["generation"], {"role": "user", "content": "What is it? And its colour?"}]
    assert proposed > 0  # prompt lookup guessed, and was checked against the images' answers
    dialog[1]["content"][1] = image(png_bytes(30, 40))  # the same tokens, another image: its own answer
    assert greedy(cached, dialog)["logprobs"] == pytest.approx(greedy(vision_llama, dialog)["logprobs"], abs=1e-4)


@settings(max_examples=25)
@given(data=st.binary(max_size=200))
def test_hostile_image_bytes_give_an_answer_or_a_value_error(vision_llama, data):
    try:
        answer = vision_llama.chat_completion([dialog_with(image(data), text("What is it?"))], max_gen_len=1)
    except ValueError as e:  # naming the input: "The N bytes given ..."
        assert str(e).startswith(f"The {len(data)} bytes given"), str(e)
        return
    assert isinstance(answer[0]["generation"]["content"], str)  # an image Pillow reads: answered


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("shards", [1, 2])
def test_two_processes_answer_as_one(vision_llama, tmp_path, tokenizer_path, shards):
    """`torchrun --nproc_per_node 2`: the encoder, the cross-attention and the text model split over two processes
    (a one-shard checkpoint resharded, or two shards) give one process's greedy tokens."""
    from helpers import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "ckpt", VISION_PARAMS, n_shards=shards, seed=3)
    out = tmp_path / "answers"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=with_repo(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    done = subprocess.run(
        [*command, str(checkpoint), tokenizer_path, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [greedy(vision_llama, dialog) for dialog in worker_dialogs()]
    for rank in range(2):
        answers = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        for answer, one_process in zip(answers, expected):
            assert answer["tokens"] == one_process["tokens"]
            assert max(abs(a - b) for a, b in zip(answer["logprobs"], one_process["logprobs"])) < 1e-4


def worker_dialogs() -> list:
    sys.path.insert(0, str(WORKER.parent))
    from vision_worker import DIALOGS

    return DIALOGS


def test_bfloat16_computes_what_float32_does(vision_llama, vision_checkpoint, tokenizer_path, process_group):
    """In bfloat16 the tiles, the encoder and the cross-attention run in bfloat16 too: the next token's
    log-probabilities stay within bfloat16's rounding of float32's."""
    half = Llama.build(str(vision_checkpoint), tokenizer_path, max_seq_len=64, device="cpu", dtype="bfloat16")
    tokens = vision_llama.formatter.encode_dialog_prompt(dialog_with(image(png_bytes(60, 40)), text("What is it?")))
    logprobs = [next_token_logprobs(llama, tokens, png_bytes(60, 40)) for llama in (vision_llama, half)]
    assert half.model.text_model.tok_embeddings.weight.dtype == torch.bfloat16
    assert (logprobs[0] - logprobs[1]).abs().max() < 0.1


@pytest.mark.slow
def test_the_example_completes_a_prompt_with_an_image(vision_checkpoint, tokenizer_path, tmp_path):
    from test_command_line import run

    picture = tmp_path / "dog.png"
    picture.write_bytes(png_bytes(50, 40))
    flags = ["--ckpt_dir", vision_checkpoint, "--tokenizer_path", tokenizer_path, "--temperature", "0"]
    result = run("example_vision_completion.py", *flags, "--image_path", picture, "--max_gen_len", "4")
    assert result.returncode == 0, result.stderr
    assert "of a vision model" in result.stdout
    assert "<dog.png> If I had to write a haiku for this one\n> " in result.stdout
    assert result.stdout.count("\n> ") == 2
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"no image here")
    result = run("example_vision_completion.py", *flags, "--image_path", broken)
    assert result.returncode == 2 and "Loaded" not in result.stdout
    assert result.stderr.startswith("error: The file") and "not an image file" in result.stderr


# KL divergence of the next token's distribution from float32's (this checkpoint: bfloat16 7e-5, int8 2.5e-4, int4 0.03)
@pytest.mark.parametrize("scheme, tolerance", [("int8", 1e-3), ("int4", 0.1)])
def test_quantize_keeps_the_text_model_s_layers_in_few_bits(
    vision_llama, vision_checkpoint, tokenizer_path, process_group, scheme, tolerance
):
    """`quantize=` quantizes the text model's linear layers, the cross-attention blocks' among them, and leaves the
    encoder in floating point; the next token's distribution stays near float32's."""
    from llama.runtime.quantized import QuantizedLinear

    quantized = Llama.build(str(vision_checkpoint), tokenizer_path, max_seq_len=64, device="cpu", quantize=scheme)
    text_model, encoder = quantized.model.text_model, quantized.model.vision_model.vision_encoder
    assert isinstance(text_model.layers[0].attention.wq, QuantizedLinear)
    assert isinstance(text_model.cross_attention_layers[0].attention.wk, QuantizedLinear)
    assert isinstance(text_model.output, QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in quantized.model.vision_model.modules())
    assert encoder.transformer.resblocks[0].attn.wq.weight.dtype == torch.bfloat16
    dialog = dialog_with(image(png_bytes(60, 40)), text("What is it?"))
    tokens = vision_llama.formatter.encode_dialog_prompt(dialog)
    logprobs = [next_token_logprobs(llama, tokens, png_bytes(60, 40)) for llama in (vision_llama, quantized)]
    assert (logprobs[0].exp() * (logprobs[0] - logprobs[1])).sum() < tolerance


def test_conversions_for_text_models_only_refuse_a_vision_model(vision_checkpoint, tmp_path):
    from llama.checkpoint.convert import quantize_checkpoint, to_gguf

    with pytest.raises(ValueError, match="Llama 3.2 Vision model, which cannot be quantized once"):
        quantize_checkpoint(vision_checkpoint, tmp_path / "int8", "int8")
    with pytest.raises(ValueError, match="Llama 3.2 Vision model, which cannot be written as GGUF"):
        to_gguf(vision_checkpoint, tmp_path / "model.gguf")
    assert not (tmp_path / "int8").exists() and not (tmp_path / "model.gguf").exists()


def images_held(llama: Llama) -> list:
    """The cache rows that hold images' keys and values."""
    return [row for row in llama.model.text_model.images.rows if row is not None]


def test_a_call_s_images_are_gone_after_it_even_after_an_error(vision_llama):
    """The keys and values of a call's images are not kept once it returns (they are 200 MiB an image in 11B), and
    a call that fails on a cheap check fails before its images are read."""
    dialog = dialog_with(image(png_bytes(40, 30)), text("What is it?"))
    vision_llama.chat_completion([dialog], temperature=0, max_gen_len=2)
    assert not images_held(vision_llama)
    stream = vision_llama.chat_completion_stream([dialog], temperature=0, max_gen_len=2)
    next(stream)
    assert images_held(vision_llama)  # while the answer streams
    stream.close()
    assert not images_held(vision_llama)
    with pytest.raises(ValueError, match="temperature"):
        vision_llama.chat_completion([dialog_with(image(b"not an image"), text("Hi"))], temperature=-1)
    with pytest.raises(ValueError, match="exceed max_batch_size"):
        vision_llama.chat_completion([dialog_with(image(b"not an image"), text("Hi"))] * 3)
    assert not images_held(vision_llama)


def test_a_vision_checkpoint_as_a_draft_model_is_refused(tiny_checkpoint, vision_checkpoint, tokenizer_path):
    with pytest.raises(ValueError, match="A draft model must be a text model, not Llama 3.2 Vision"):
        Llama.build(str(tiny_checkpoint), tokenizer_path, max_seq_len=64, device="cpu", draft=str(vision_checkpoint))


def test_compiling_a_vision_model_s_step_is_refused(vision_llama):
    with pytest.raises(ValueError, match="decodes eagerly"):
        vision_llama.compile_decode_step()


def test_an_image_past_the_shortest_prompt_is_still_the_image(vision_llama):
    """A batch answers each prompt as it is answered alone, wherever its image stands. (llama-models' generate
    embeds an <|image|> at or past the shortest prompt's length as token 0: a bug of its, not kept.)"""
    long_one = dialog_with(text("Here is a picture of my garden in the spring:"), image(png_bytes(50, 40)), text("?"))
    short_one = [{"role": "user", "content": "Hi"}]
    alone = greedy(vision_llama, long_one)
    together = vision_llama.chat_completion([short_one, long_one], temperature=0, max_gen_len=STEPS, logprobs=True)
    assert together[1]["tokens"] == alone["tokens"]
    assert max(abs(a - b) for a, b in zip(together[1]["logprobs"], alone["logprobs"])) < 1e-4
