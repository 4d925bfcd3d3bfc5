"""Images on the command line (Llama 3.2 Vision): `/image` and image files named in a chat message reach the model
as image parts before the text, a bad image is one line and nothing is sent, a text model refuses them, /save and
/load keep them by path, and `llama complete --image` starts the prompt with them. The model is a tiny random vision
checkpoint; the chat's dialogs are recorded on their way to it."""

import io
import json
import random
import time
from pathlib import Path

import pytest
from helpers import VISION_PARAMS, make_checkpoint
from PIL import Image
from test_chat_input import reader

import llama.cli.main
from llama import Llama
from llama.cli.chat import run_chat
from llama.cli.chat_images import image_paths_in

MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("vision") / "tiny", VISION_PARAMS)


@pytest.fixture(scope="module")
def vision_llama(vision_checkpoint, tokenizer_path, process_group) -> Llama:
    return Llama.build(str(vision_checkpoint), tokenizer_path, MAX_SEQ_LEN, max_batch_size=1, device="cpu")


def picture(path: Path, width: int, height: int, seed: int = 0) -> Path:
    """Write an image of random pixels (its format from the file's extension) and return its path."""
    pixels = random.Random(seed).randbytes(width * height * 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.frombytes("RGB", (width, height), pixels).save(path)
    return path


def pixels_of(path: Path) -> bytes:
    return Image.open(path).convert("RGB").tobytes()


class Recording:
    """A Llama that keeps a copy of each dialog the chat sends it, then answers as the Llama does."""

    def __init__(self, llama: Llama):
        self.llama = llama
        self.model, self.formatter, self.decoder = llama.model, llama.formatter, llama.decoder
        self.dialogs = []

    def chat_completion_stream(self, dialogs, *args, **kwargs):
        self.dialogs.append([dict(message) for message in dialogs[0]])
        yield from self.llama.chat_completion_stream(dialogs, *args, **kwargs)


def chat(generator, *lines) -> str:
    out = io.StringIO()
    run_chat(generator, temperature=0, max_gen_len=3, input_fn=reader(*lines), out=out)
    return out.getvalue()


def assert_image(part: dict, path: Path) -> None:
    """`part` is an image part holding the pixels of the file at `path`."""
    assert part["type"] == "image"
    assert part["image"].size == Image.open(path).size
    assert part["image"].tobytes() == pixels_of(path)


# The chat ----------------------------------------------------------------------------------------------------------


def test_image_command_attaches_images_before_the_text_in_order(vision_llama, tmp_path):
    first = picture(tmp_path / "first.png", 40, 30, seed=1)
    second = picture(tmp_path / "with space" / "second one.png", 20, 50, seed=2)
    model = Recording(vision_llama)
    out = chat(model, f"/image {first}", f'/image "{second}"', "What differs?", "/exit")
    assert "[image: first.png, 40x30: it goes with the next message]" in out
    assert "[image: second one.png, 20x50: it goes with the next message]" in out
    assert out.count("Assistant: ") == 1
    [dialog] = model.dialogs
    [message] = dialog
    assert message["role"] == "user"
    image_1, image_2, text = message["content"]
    assert_image(image_1, first)
    assert_image(image_2, second)
    assert text == {"type": "text", "text": "What differs?"}


def test_an_image_file_named_in_a_message_is_attached_and_the_text_kept(vision_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    dog = picture(tmp_path / "photos" / "dog.jpg", 60, 40, seed=3)
    cat = picture(tmp_path / "my cat.PNG", 30, 30, seed=4)
    text = 'What is in ~/photos/dog.jpg? And in "my cat.PNG", or in missing.png? Compare (~/photos/dog.jpg).'
    model = Recording(vision_llama)
    out = chat(model, text, "/exit")
    assert "[image: dog.jpg, 60x40]\n[image: my cat.PNG, 30x30]\nAssistant: " in out
    [[message]] = model.dialogs
    dog_part, cat_part, text_part = message["content"]  # each file once, in the order first named
    assert_image(dog_part, dog)
    assert_image(cat_part, cat)
    assert text_part == {"type": "text", "text": text}  # as typed


@pytest.mark.parametrize(
    "text, named",
    [
        ("a.png", ["a.png"]),
        ("See (a.png), then a.png.", ["a.png"]),
        ("it's in 'b c.jpeg': look", ["b c.jpeg"]),
        ('"b c.jpeg"!', ["b c.jpeg"]),
        ("'b c.jpeg", []),  # never closed: the words 'b and c.jpeg, neither a file
        ("UP.GIF and a.PNG", ["UP.GIF"]),  # a.PNG is no file where names have case
        ("a.txt.png? notes.txt a.png/", []),
    ],
)
def test_which_words_name_image_files(tmp_path, monkeypatch, text, named):
    monkeypatch.chdir(tmp_path)
    for name in ("a.png", "b c.jpeg", "UP.GIF", "notes.txt"):
        (tmp_path / name).write_bytes(b"")  # what the files hold is looked at once they are attached
    assert image_paths_in(text) == [str(tmp_path / name) for name in named]


def test_looking_for_paths_takes_linear_time_on_hostile_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    n = 200_000
    hostile = [
        '"' * n,  # quotes that pair up far apart
        "'a " * n,  # words that open a quote no word closes
        "\"a 'b " * n,
        "x.png " * n,  # the same missing file named again and again
        "(" * n + "x.png" + ")" * n,
        "x" * n + ".png",
    ]
    start = time.perf_counter()
    for text in hostile:
        assert image_paths_in(text) == []
    assert time.perf_counter() - start < 5  # about 1 s here; quadratic would take hours


def test_a_bad_image_is_one_line_and_nothing_is_sent(vision_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = picture(tmp_path / "good.png", 30, 20, seed=5)
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(good.read_bytes()[:200])
    (tmp_path / "notes.png").write_text("not an image\n")
    model = Recording(vision_llama)
    lines = ["/image missing.png", f"/image {truncated}", "/image", f"/image {good}", "Describe notes.png", "Hello"]
    out = chat(model, *lines, "/exit")
    assert f"[No image file at '{tmp_path / 'missing.png'}': check the path.]\n" in out
    assert "[/image needs a file name: /image PATH]" in out
    problems = [line for line in out.splitlines() if str(tmp_path / "cut.png") in line or "notes.png" in line]
    assert len(problems) == 2 and all(line.startswith("[") and line.endswith("]") for line in problems)
    assert "it may be truncated or damaged" in problems[0]
    assert "is not an image file Pillow can read" in problems[1] and problems[1].endswith("The message was not sent.]")
    # Only "Hello" reached the model, with the image /image attached before the refused message.
    assert out.count("Assistant: ") == 1
    [[message]] = model.dialogs
    assert_image(message["content"][0], good)
    assert message["content"][1:] == [{"type": "text", "text": "Hello"}]


def test_a_text_model_refuses_images_and_sends_paths_as_text(tiny_llama, tmp_path):
    photo = picture(tmp_path / "photo.png", 10, 10)
    model = Recording(tiny_llama)
    out = chat(model, f"/image {photo}", f"What is in {photo}?", "/help", "/exit")
    assert "[This model takes no images: it is a text model. /image needs a Llama 3.2 Vision checkpoint]" in out
    assert "\n  /image PATH " in out  # /help lists it
    assert model.dialogs == [[{"role": "user", "content": f"What is in {photo}?"}]]


def test_save_and_load_keep_images_by_path(vision_llama, tiny_llama, tmp_path):
    photo = picture(tmp_path / "photo.png", 30, 40, seed=6)
    saved = tmp_path / "dialog.json"
    out = chat(Recording(vision_llama), f"/image {photo}", "What is it?", f"/save {saved}")
    assert f"[saved 2 messages to {saved} (1 image(s) by their paths)]" in out
    dialog = json.loads(saved.read_text())
    assert dialog[0] == {
        "role": "user",
        "content": [{"type": "image", "image": str(photo)}, {"type": "text", "text": "What is it?"}],
    }
    assert dialog[1]["role"] == "assistant"

    model = Recording(vision_llama)
    out = chat(model, f"/load {saved}", "And now?", "/exit")
    assert f"[loaded 2 messages from {saved}]" in out
    [sent] = model.dialogs
    assert_image(sent[0]["content"][0], photo)
    assert sent[0]["content"][1] == {"type": "text", "text": "What is it?"}
    assert sent[1:] == [dialog[1], {"role": "user", "content": "And now?"}]

    out = chat(tiny_llama, f"/load {saved}", "/exit")
    assert f"[{saved} holds images, and this model takes no images: it is a text model]" in out
    photo.unlink()
    out = chat(vision_llama, f"/load {saved}", "/exit")
    assert f"[message 0 of {saved}: No image file at '{photo}': check the path.]" in out


# llama complete --image --------------------------------------------------------------------------------------------


def complete(capsys, monkeypatch, checkpoint, tokenizer_path, *args):
    """Run `llama complete` in this process, leaving the logging set-up as it is; (exit status, stdout, stderr)."""
    monkeypatch.setattr(llama.cli.main, "show_logs", lambda verbose=False: None)
    flags = ["--tokenizer_path", tokenizer_path, "--max_seq_len", str(MAX_SEQ_LEN), "--temperature", "0"]
    flags += ["--max_gen_len", "4", "--device", "cpu"]
    try:
        llama.cli.main.main(["complete", str(checkpoint), *map(str, args), *flags])
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_complete_with_images_starts_the_prompt_with_them(
    vision_checkpoint, vision_llama, tokenizer_path, tmp_path, capsys, monkeypatch
):
    first = picture(tmp_path / "first.png", 50, 30, seed=7)
    second = picture(tmp_path / "second.jpg", 20, 20, seed=8)
    prompts = []
    stream = Llama.text_completion_stream

    def recorded(self, batch, *args, **kwargs):
        prompts.extend(batch)
        return stream(self, batch, *args, **kwargs)

    monkeypatch.setattr(Llama, "text_completion_stream", recorded)
    code, out, err = complete(
        capsys, monkeypatch, vision_checkpoint, tokenizer_path, "A haiku:", "--image", first, "--image", second
    )
    assert code == 0, err
    assert "of a vision model" in err
    [prompt] = prompts
    assert_image(prompt[0], first)
    assert_image(prompt[1], second)
    assert prompt[2] == {"type": "text", "text": "A haiku:"}
    images = [{"type": "image", "image": Image.open(path)} for path in (first, second)]
    expected = vision_llama.text_completion([[*images, prompt[2]]], temperature=0, max_gen_len=4)[0]["generation"]
    assert out == expected + "\n"


def test_complete_refuses_a_bad_image_and_a_text_model_before_loading(
    vision_checkpoint, tiny_checkpoint, tokenizer_path, tmp_path, capsys, monkeypatch
):
    missing = tmp_path / "missing.png"
    code, out, err = complete(capsys, monkeypatch, vision_checkpoint, tokenizer_path, "Hi", "--image", missing)
    assert (code, out, err) == (2, "", f"error: No image file at '{missing}': check the path.\n")
    photo = picture(tmp_path / "photo.png", 10, 10)
    code, out, err = complete(capsys, monkeypatch, tiny_checkpoint, tokenizer_path, "Hi", "--image", photo)
    assert (code, out) == (2, "")
    assert err == (
        f"error: This model takes no images: {tiny_checkpoint} holds a text model. --image needs a Llama 3.2 Vision "
        "checkpoint\n"
    )
