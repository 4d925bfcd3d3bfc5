"""`llama serve` on a Llama 3.2 Vision checkpoint (tiny, random weights, float32), driven by the `openai` client: images
sent as base64 `data:` URLs get the answers `Llama.chat_completion` gives with the same images, alone, side by side
with other requests, and over a conversation's turns (the prefix cache reusing only what precedes the image); under
torchrun, two processes answer as one. What the server refuses (an http URL, a damaged image, too many images, an
image for a text model) is tested with the protocol in tests/test_serve_image_parts.py."""

import base64
import shutil
import signal
import sys
import threading
from pathlib import Path

import pytest
from helpers import VISION_PARAMS, import_or_skip, make_checkpoint, png_bytes

httpx = import_or_skip("httpx", "pip install -e '.[test]'")
openai = import_or_skip("openai", "pip install -e '.[test]'")
import_or_skip("fastapi", "pip install -e '.[serve]'")

from serve_process import Server  # noqa: E402

MODEL = "tiny-vision"
MAX_SEQ_LEN = 256
ROWS = 3
STEPS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_path) -> Path:
    folder = make_checkpoint(tmp_path_factory.mktemp("serve-vision") / MODEL, VISION_PARAMS, seed=5)
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="module")
def reference(checkpoint, process_group):
    from llama import Llama

    return Llama.build(str(checkpoint), max_seq_len=MAX_SEQ_LEN, max_batch_size=1, device="cpu", dtype="float32")


def start_server(checkpoint: Path, log: Path, **launch) -> Server:
    flags = ["--max_batch_size", str(ROWS), "--max_seq_len", str(MAX_SEQ_LEN), "--dtype", "float32"]
    return Server(checkpoint, log, *flags, "--prefill_chunk", "16", "--model_name", MODEL, **launch)


@pytest.fixture(scope="module")
def server(checkpoint, reference, tmp_path_factory):
    running = start_server(checkpoint, tmp_path_factory.mktemp("log") / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def openai_message(question: str, *images: bytes) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": question}]}


def llama_message(question: str, *images: bytes) -> dict:
    parts = [{"type": "image", "image": image} for image in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": question}]}


def served(client, messages: list) -> dict:
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=STEPS, temperature=0, logprobs=True
    )
    choice = answer.choices[0]
    return {
        "content": choice.message.content,
        "logprobs": [entry.logprob for entry in choice.logprobs.content],
        "cached": answer.usage.prompt_tokens_details.cached_tokens,
        "prompt_tokens": answer.usage.prompt_tokens,
    }


def expected(reference, dialog: list) -> dict:
    answer = reference.chat_completion([dialog], temperature=0, max_gen_len=STEPS, logprobs=True)[0]
    return {"content": answer["generation"]["content"], "logprobs": answer["logprobs"]}


def assert_same_answer(got: dict, want: dict) -> None:
    assert got["content"] == want["content"]
    assert got["logprobs"][: len(want["logprobs"])] == pytest.approx(want["logprobs"], abs=1e-4)


def test_models_say_the_model_takes_images(client):
    assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]


@pytest.mark.parametrize("size", [(40, 30), (30, 90), (90, 40)])
def test_an_image_s_answer_is_chat_completion_s(client, reference, size):
    image = png_bytes(*size, seed=size[0])
    got = served(client, [openai_message("What is in this picture?", image)])
    assert_same_answer(got, expected(reference, [llama_message("What is in this picture?", image)]))


def test_two_images_and_a_text_only_message(client, reference):
    first, second = png_bytes(50, 50, seed=1), png_bytes(20, 60, mode="L", seed=2)
    got = served(client, [openai_message("Which differ?", first, second)])
    assert_same_answer(got, expected(reference, [llama_message("Which differ?", first, second)]))
    text_only = [{"role": "user", "content": "Describe a cat."}]
    assert_same_answer(served(client, text_only), expected(reference, text_only))


def test_requests_side_by_side_each_see_their_own_images(client, reference):
    """Three requests at once, in three rows decoded together: two with other images, one of text only."""
    cases = {
        "a": [openai_message("What is it?", png_bytes(40, 40, seed=7))],
        "b": [openai_message("What is it?", png_bytes(60, 30, seed=8))],
        "c": [{"role": "user", "content": "What is it?"}],
    }
    answers = {}

    def ask(name):
        answers[name] = served(client, cases[name])

    threads = [threading.Thread(target=ask, args=(name,)) for name in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    llama_cases = {
        "a": [llama_message("What is it?", png_bytes(40, 40, seed=7))],
        "b": [llama_message("What is it?", png_bytes(60, 30, seed=8))],
        "c": cases["c"],
    }
    for name, dialog in llama_cases.items():
        assert_same_answer(answers[name], expected(reference, dialog))
    assert answers["a"]["content"] != answers["b"]["content"]  # each row read its own image


def test_a_conversation_reuses_what_precedes_its_image_and_answers_as_chat_completion(client, reference):
    system = "You answer questions about pictures in a few words, plainly, and never more than asked."
    image, other = png_bytes(45, 35, seed=11), png_bytes(45, 35, seed=12)
    messages = [{"role": "system", "content": system}, openai_message("What is it?", image)]
    dialog = [{"role": "system", "content": system}, llama_message("What is it?", image)]
    first_image = reference.formatter.encode_dialog_prompt(dialog).index(
        reference.tokenizer.special_tokens["<|image|>"]
    )
    for turn in range(2):
        got = served(client, messages)
        assert_same_answer(got, expected(reference, dialog))
        assert got["cached"] <= first_image
        reply = {"role": "assistant", "content": got["content"]}
        messages += [reply, {"role": "user", "content": "And its colour?"}]
        dialog += [reply, {"role": "user", "content": "And its colour?"}]
    assert got["cached"] > 0  # the system prompt, from the first turn's row
    # The same tokens with another image: nothing the first image's keys and values shaped is reused.
    messages[1], dialog[1] = openai_message("What is it?", other), llama_message("What is it?", other)
    assert_same_answer(served(client, messages), expected(reference, dialog))


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_two_processes_serve_one_process_s_answers(checkpoint, client, tmp_path):
    sharded = make_checkpoint(tmp_path / MODEL, VISION_PARAMS, seed=5, n_shards=2)
    shutil.copy(checkpoint / "tokenizer.model", sharded / "tokenizer.model")
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m")
    running = start_server(sharded, tmp_path / "server.log", launcher=launcher)
    questions = [[openai_message("What is it?", png_bytes(40, 30, seed=k))] for k in range(2)]
    questions.append([{"role": "user", "content": "What is it?"}])
    try:
        two_processes = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=120)
        answers = [served(two_processes, messages) for messages in questions]
        running.process.send_signal(signal.SIGTERM)  # torchrun passes it on to both processes: they drain and exit
        running.process.wait(timeout=60)
    finally:
        running.stop()
    for messages, answer in zip(questions, answers):
        one_process = served(client, messages)
        assert answer["content"] == one_process["content"]
        assert answer["logprobs"] == pytest.approx(one_process["logprobs"], abs=1e-4)
