"""Property-based fuzzing of what a user or a file hands the library: the tokenizer (text, token IDs, tokenizer.model
files), params.json and config.json, and the generation arguments.

The property everywhere: an input either works, or raises a ValueError (FileNotFoundError for a missing file) whose
message names what is wrong; nothing else escapes, neither a raw error from torch, tiktoken or json nor a Rust panic
(a BaseException, which pytest reports as an error). Where the rule is simple, an independent oracle written here
says which inputs must work. The default profile of conftest.py runs a bounded, repeatable number of examples;
`HYPOTHESIS_PROFILE=long python -m pytest tests/test_fuzz_inputs.py` searches far wider.
"""

import base64
import json
import math
import numbers
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_PARAMS, VISION_PARAMS
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from llama.checkpoint import HF_CONFIG_FIELDS, PARAMS_FIELDS, model_args_from, open_checkpoint
from llama.cli.convert import main as convert_main
from llama.tokenizer import Tokenizer

BOS = 128000
VOCAB = 128256
# A session fixture used inside @given is shared by every example, which is what we want here.
shared_fixtures = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

# Any JSON value, with the numbers that break things: NaN, infinities, huge and negative integers, bounds.
json_numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**12, 2**12 + 1, 2**20 + 1, 2**24 + 1, 2**31, 2**63, 10**19, 10**30, 2**41]),
    st.floats(),
    st.sampled_from([0.0, -0.0, 1e-300, 1e12, 1.0000001e12, 1e30, 1e300]),
)
json_scalars = st.one_of(st.none(), st.booleans(), json_numbers, st.text(max_size=8))
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


def names_the_problem(error: Exception, *names: str) -> bool:
    return any(name in str(error) for name in names)


# The tokenizer -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    return Tokenizer(tokenizer_path)


@shared_fixtures
@given(text=st.text())
def test_any_text_encodes_and_decodes_back(tokenizer, text):
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == BOS + 1 and all(0 <= i < VOCAB for i in ids)
    expected = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")  # lone surrogates cannot be kept
    assert tokenizer.decode(ids[1:-1]) == expected


token_like = st.one_of(
    st.integers(min_value=0, max_value=VOCAB - 1),
    st.integers(),
    st.booleans(),
    st.floats(),
    st.text(max_size=3),
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda x: np.int64(x % 2**63)),
    st.just(np.bool_(True)),
    st.just(np.float32(5.0)),
)


def is_token_id(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x < VOCAB


@shared_fixtures
@given(ids=st.lists(token_like, max_size=6))
def test_any_ids_decode_or_the_first_bad_one_is_named(tokenizer, ids):
    for decode in (tokenizer.decode, tokenizer.decode_bytes):
        bad = [(i, x) for i, x in enumerate(ids) if not is_token_id(x)]
        if not bad:
            assert decode(ids) == decode([int(x) for x in ids])
            continue
        with pytest.raises(ValueError) as caught:
            decode(ids)
        position, value = bad[0]
        assert f"at position {position}" in str(caught.value)
        assert repr(value)[:20] in str(caught.value) or "bits" in str(caught.value)


def byte_level_lines() -> list:
    lines = [base64.b64encode(bytes([b])) + b" %d" % b for b in range(256)]
    merges = [b"Hi", b"ey", b"he", b" t", b"the", b"\xe6\x97"]
    return lines + [base64.b64encode(m) + b" %d" % (256 + i) for i, m in enumerate(merges)]


@st.composite
def mutated_model_files(draw) -> bytes:
    """A small byte-level BPE file with a few lines changed as a damaged or hand-edited file might be."""
    lines = byte_level_lines()
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        kind = draw(st.sampled_from(["rank", "duplicate", "delete", "swap", "garbage", "spacing", "token"]))
        token, rank = (lines[i].split() + [b"", b""])[:2]
        if kind == "rank":
            lines[i] = token + b" " + str(draw(json_numbers if draw(st.booleans()) else st.integers(-3, 270))).encode()
        elif kind == "duplicate":
            lines.insert(draw(st.integers(min_value=0, max_value=len(lines))), lines[i])
        elif kind == "delete":
            del lines[i]
        elif kind == "swap":
            j = draw(st.integers(min_value=0, max_value=len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "garbage":
            lines[i] = draw(st.binary(max_size=12))
        elif kind == "spacing":
            lines[i] = draw(st.sampled_from([b"", b"  ", b"\t", b"\r"])).join([token, rank]) + draw(
                st.sampled_from([b"", b" ", b"\r", b" x"])
            )
        else:
            lines[i] = base64.b64encode(draw(st.binary(max_size=4))) + b" " + rank
    return draw(st.sampled_from([b"\n", b"\r\n"])).join(lines) + draw(st.sampled_from([b"", b"\n", b"\n\n"]))


def reference_ranks(data: bytes):
    """The ranks a sound file holds, or None: written here independently of llama/tokenizer.py."""
    ranks = {}
    for line in data.splitlines():
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            return None
        try:
            token = base64.b64decode(fields[0], validate=True)
        except ValueError:
            return None
        if not token or token in ranks:
            return None
        ranks[token] = int(fields[1])
    sound = sorted(ranks.values()) == list(range(len(ranks))) and all(bytes([b]) in ranks for b in range(256))
    return ranks if sound else None


@given(data=mutated_model_files())
def test_any_tokenizer_file_loads_or_its_problem_is_named(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(data)
    expected = reference_ranks(data)
    try:
        tokenizer = Tokenizer(str(path))
    except ValueError as e:
        assert expected is None, f"a sound file was refused: {e}"
        assert str(path) in str(e) and names_the_problem(e, "line ", "bytes")
        return
    assert expected is not None, "a damaged file was loaded"
    assert tokenizer.model._mergeable_ranks == expected
    assert tokenizer.bos_id == len(expected)
    text = "Hi hey the \u65e5"
    assert tokenizer.decode(tokenizer.encode(text, bos=False, eos=False)) == text


# params.json and config.json ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_folder(tiny_checkpoint, tmp_path_factory):
    return shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("meta") / "ckpt")


@pytest.fixture(scope="module")
def hf_folder(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "hf"
    convert_main(["to-hf", str(tiny_checkpoint), str(out)])
    return out


def opens_or_names(folder: Path, file_name: str, *names: str):
    """open_checkpoint(folder) and the model's arguments, or None after checking the error names the file and one of
    `names` (a field), or the arguments that do not fit together."""
    try:
        reader = open_checkpoint(folder)
        return model_args_from(reader.params)[0]
    except ValueError as e:
        assert names_the_problem(e, file_name, "divisible", "odd", "use_scaled_rope", *names), str(e)
        return None


@given(field=st.sampled_from(sorted(PARAMS_FIELDS)), value=json_values)
def test_any_params_json_value_works_or_is_named(meta_folder, field, value):
    (meta_folder / "params.json").write_text(json.dumps({**TINY_PARAMS, field: value}))
    args = opens_or_names(meta_folder, "params.json", field)
    if args is not None:
        assert args.dim * args.n_layers * args.vocab_size < 2**63
        assert all(math.isfinite(x) for x in (args.norm_eps, args.rope_theta, args.ffn_hidden_dim))


@given(extra=st.dictionaries(st.text(max_size=12), json_values, max_size=4))
def test_any_extra_params_json_keys_are_ignored_and_named(meta_folder, extra):
    params = {**TINY_PARAMS, **{k: v for k, v in extra.items() if k not in TINY_PARAMS and k not in PARAMS_FIELDS}}
    assume(not ({"quantization", "tie_word_embeddings"} & set(params)))  # keys with a meaning of their own
    (meta_folder / "params.json").write_text(json.dumps(params))
    reader = open_checkpoint(meta_folder)
    args, ignored = model_args_from(reader.params)
    assert set(ignored) == set(params) - set(TINY_PARAMS)
    assert (args.max_seq_len, args.max_batch_size) == (2048, 32)  # never taken from the file


@given(depth=st.integers(min_value=0, max_value=5000), kind=st.sampled_from(["[]", "{}"]))
def test_any_nesting_of_params_json_works_or_is_named(meta_folder, depth, kind):
    opening, closing = ('{"a": ' * depth, "}" * depth) if kind == "{}" else ("[" * depth, "]" * depth)
    text = json.dumps({**TINY_PARAMS, "note": "here"}).replace('"here"', opening + "1" + closing)
    (meta_folder / "params.json").write_text(text)
    try:
        open_checkpoint(meta_folder)
    except ValueError as e:
        assert depth >= 32 and "deeper than 32 levels" in str(e)
    else:
        assert depth < 32


hf_fields = sorted(HF_CONFIG_FIELDS) + ["architectures", "model_type", "rope_scaling", "rope_parameters"]
rope_dicts = st.fixed_dictionaries(
    {},
    optional={
        "rope_type": st.sampled_from(["llama3", "default", "linear"]) | json_scalars,
        "factor": json_values,
        "rope_theta": json_values,
        "low_freq_factor": json_values,
        "original_max_position_embeddings": json_values,
    },
)


@given(field=st.sampled_from(hf_fields), value=json_values | rope_dicts)
def test_any_config_json_value_works_or_is_named(hf_folder, field, value):
    config_path = hf_folder / "config.json"
    original = config_path.read_text()
    try:
        config_path.write_text(json.dumps({**json.loads(original), field: value}))
        args = opens_or_names(hf_folder, "config.json", field)
        if args is not None:
            assert all(math.isfinite(x) for x in (args.norm_eps, args.rope_theta))
    finally:
        config_path.write_text(original)


# Generation arguments -----------------------------------------------------------------------------------------

real_or_not = st.one_of(
    st.floats(),
    st.floats(min_value=0, max_value=2),
    st.floats(min_value=0, max_value=1e-30),
    st.integers(min_value=-2, max_value=3),
    st.sampled_from([10**400, True, False, None, "0.5", np.float32(0.5), np.float64(1e-300), np.bool_(False)]),
)
gen_lens = st.one_of(st.integers(min_value=-2, max_value=3), st.sampled_from([True, 2.0, "2", np.int64(2), -(10**30)]))
# Mostly arguments that work, so that generation itself runs in a good share of the examples.
temperatures = st.one_of(st.floats(min_value=0, max_value=2), st.floats(min_value=0, max_value=1e-30), real_or_not)
top_ps = st.one_of(st.floats(min_value=0, max_value=1, exclude_min=True), st.just(1.0), real_or_not)
usual_gen_lens = st.one_of(st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=3), gen_lens)


def bad_arguments(temperature, top_p, max_gen_len) -> set:
    """The sampling arguments that must be refused, by an oracle written here."""

    def real(x):
        if not isinstance(x, numbers.Real) or isinstance(x, (bool, np.bool_)):
            return None
        try:
            return float(x)
        except OverflowError:
            return None

    bad = set()
    if real(temperature) is None or not (math.isfinite(real(temperature)) and real(temperature) >= 0):
        bad.add("temperature")
    if real(top_p) is None or not 0 < real(top_p) <= 1:
        bad.add("top_p")
    if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, (int, np.integer)) or max_gen_len < 0:
        bad.add("max_gen_len")
    return bad


@shared_fixtures
@given(
    prompts=st.lists(
        st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=4)
        | st.lists(token_like, min_size=1, max_size=4),
        min_size=1,
        max_size=2,
    ),
    temperature=temperatures,
    top_p=top_ps,
    max_gen_len=usual_gen_lens,
)
def test_any_generate_arguments_work_or_are_named(tiny_llama, prompts, temperature, top_p, max_gen_len):
    bad = bad_arguments(temperature, top_p, max_gen_len)
    bad_prompt = next((i for i, p in enumerate(prompts) if not all(map(is_token_id, p))), None)
    if bad_prompt is not None:
        bad.add(f"Prompt {bad_prompt}: token ID")
    try:
        tokens, _ = tiny_llama.generate(prompts, max_gen_len, temperature, top_p)
    except ValueError as e:
        assert str(e).startswith(tuple(bad)) if bad else False, str(e)
        event("refused")
        return
    event("generated")
    assert not bad
    assert all(len(row) <= max_gen_len and all(type(t) is int and 0 <= t < VOCAB for t in row) for row in tokens)


@pytest.mark.slow
@shared_fixtures
@given(prompt=st.text(max_size=12), temperature=temperatures, top_p=top_ps, max_gen_len=usual_gen_lens)
def test_any_text_completion_arguments_work_or_are_named(tiny_llama, prompt, temperature, top_p, max_gen_len):
    bad = bad_arguments(temperature, top_p, max_gen_len) | ({"Prompt 0 is empty"} if not prompt else set())
    try:
        result = tiny_llama.text_completion([prompt], temperature, top_p, max_gen_len)
    except ValueError as e:
        assert str(e).startswith(tuple(bad)) if bad else False, str(e)
        return
    assert not bad and isinstance(result[0]["generation"], str)


# Llama 3.2 Vision: params.json's vision fields and a message's content parts ---------------------------------------

VISION_FIELDS = sorted(set(VISION_PARAMS) - set(TINY_PARAMS) - {"use_scaled_rope"})


@given(field=st.sampled_from(VISION_FIELDS), value=json_values)
def test_any_vision_params_value_works_or_is_named(field, value):
    from llama.vision.model import vision_args_from

    try:
        vision = vision_args_from({**VISION_PARAMS, field: value}, VISION_PARAMS["n_layers"])
    except ValueError as e:
        assert names_the_problem(e, field, "vision_chunk_size", "Intermediate layers", "encoder width"), str(e)
        return
    encoder = vision.encoder
    assert 0 < vision.cross_attention_layers <= VISION_PARAMS["n_layers"]
    assert 0 < encoder.tokens_per_tile * encoder.feature_dim < 2**63 and encoder.width % encoder.heads == 0


content_parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "image_url", ""])},
    optional={"text": json_values, "image": json_values},
)


def content_works(content) -> bool:
    """Independently of llama.tokenizer.content: a str, or a list of text parts (a str under "text") and image parts
    (any value under "image": an image is read later)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict)
        and (
            (part.get("type") == "text" and isinstance(part.get("text"), str))
            or (part.get("type") == "image" and "image" in part)
        )
        for part in content
    )


@pytest.fixture(scope="module")
def vision_chat(tokenizer_path):
    from llama.tokenizer import ChatFormat

    return ChatFormat(Tokenizer(tokenizer_path, version="3.1"))  # the tokenizer of Llama 3.2 Vision


@given(content=st.one_of(json_values, st.lists(st.one_of(content_parts, json_values), max_size=4)))
def test_any_message_content_encodes_or_is_named(vision_chat, content):
    chat = vision_chat
    try:
        tokens = chat.encode_message({"role": "user", "content": content})
    except ValueError as e:
        assert not content_works(content) and str(e).startswith("Content"), str(e)
        return
    assert content_works(content)
    images = sum(1 for part in content if part["type"] == "image") if isinstance(content, list) else 0
    assert tokens.count(128011) == images
