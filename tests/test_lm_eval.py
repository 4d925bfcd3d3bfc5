"""EleutherAI's lm-evaluation-harness against `llama serve`, as its users evaluate a model behind vLLM: the
`local-completions` model with its tokenizer found on the server (/tokenizer_info, /tokenize), token-ID prompts,
echo with logprobs for loglikelihood, and generate_until. Two small tasks of our own, on local files (no download).
Its log-likelihoods must be the Python API's on the same weights, in float32."""

import shutil
import textwrap

import pytest
from helpers import TINY_PARAMS, import_or_skip, make_checkpoint

lm_eval = import_or_skip("lm_eval", "pip install -e '.[test]'")
import_or_skip("fastapi", "pip install -e '.[serve]'")
from serve_process import Server  # noqa: E402

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a city"], "answer": 0},
    {"question": "Two plus two makes", "choices": [" four", " five"], "answer": 0},
    {"question": "Llamas live in the", "choices": [" Andes", " sea", " clouds above"], "answer": 0},
]
CHOICE_TASK = """
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATE_TASK = """
task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_path):
    folder = make_checkpoint(tmp_path_factory.mktemp("lm_eval") / "tiny", TINY_PARAMS)
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    running = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--max_seq_len", "256",
                     "--model_name", "tiny")  # fmt: skip
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(checkpoint, process_group):
    from llama import Llama

    return Llama.build(str(checkpoint), max_seq_len=256, max_batch_size=1, device="cpu")


def encode_pair(tokenizer, context: str, continuation: str):
    """lm-eval's split of a (context, continuation) pair into tokens: trailing spaces go with the continuation,
    the whole is encoded and cut where the context's tokens end; no <|begin_of_text|>."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, bos=False, eos=False)
    context_tokens = tokenizer.encode(context, bos=False, eos=False)
    return context_tokens, whole[len(context_tokens) :]


@pytest.mark.slow
def test_lm_eval_scores_and_generates_against_the_server(server, reference, tmp_path, monkeypatch):
    import json

    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tiny_choice.yaml").write_text(textwrap.dedent(CHOICE_TASK.format(data=data)))
    (tmp_path / "tiny_generate.yaml").write_text(textwrap.dedent(GENERATE_TASK.format(data=data)))
    model_args = f"model=tiny,base_url={server.url}/v1/completions,batch_size=2,max_retries=1,max_length=256"
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["tiny_choice", "tiny_generate"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    scored = 0
    for sample in results["samples"]["tiny_choice"]:
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
            context_tokens, continuation_tokens = encode_pair(reference.tokenizer, context, continuation)
            tokens = context_tokens + continuation_tokens
            _, logprobs = reference.generate([tokens], 0, temperature=0, logprobs=True, echo=True)
            assert loglikelihood == pytest.approx(sum(logprobs[0][len(context_tokens) :]), abs=1e-3)
            scored += 1
    assert scored == sum(len(q["choices"]) for q in QUESTIONS)
    generations = [sample["resps"][0][0] for sample in results["samples"]["tiny_generate"]]
    assert len(generations) == len(QUESTIONS) and all(isinstance(g, str) for g in generations)
    assert "acc,none" in results["results"]["tiny_choice"]
