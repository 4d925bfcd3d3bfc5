"""Property-based tests (Hypothesis) of the chat format and the tools module: whatever a client sends or a model
writes either works or is a ValueError whose message says what is wrong; nothing else escapes (no TypeError,
KeyError or RecursionError), and nothing takes long.

The default profile (tests/conftest.py) runs a fixed, bounded number of examples; `HYPOTHESIS_PROFILE=long python
-m pytest tests -q -k fuzz` searches far wider.
"""

import json
import keyword
import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llama import ChatFormat, Tokenizer
from llama.tokenizer import BUILTIN_TOOLS, STOP_REASONS, TOOL_PROMPT_FORMATS
from llama.tokenizer.chat_format import _ASSISTANT_HEADER
from llama.tokenizer.tool_calls import _function_tag
from llama.tools import (
    Tool,
    function_tag_tools_prompt,
    json_tools_prompt,
    python_list_tools_prompt,
    run_tool_call,
    system_prompt,
    tool_messages,
)

EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
PYTHON_TAG = "<|python_tag|>"


@pytest.fixture(scope="module")
def tok(tokenizer_path) -> Tokenizer:
    return Tokenizer(tokenizer_path, version="3.1")


@pytest.fixture(scope="module")
def tok3(tokenizer_path) -> Tokenizer:
    return Tokenizer(tokenizer_path, version="3")


def raises_a_clear_value_error(action) -> bool:
    """Runs `action`; True if it raised a ValueError with a message, False if it returned. Anything else fails."""
    try:
        action()
    except ValueError as e:
        assert str(e).strip(), "a ValueError must say what is wrong"
        return True
    return False


# Reading answers ----------------------------------------------------------------------------------------------

# Pieces of every form a call can take, and of what breaks them.
FRAGMENTS = [
    "<function=", "<function=f>", "</function>", ">", ">{", "{", "}", "[", "]", "(", ")", "=", ",", ":", '"', "'", "\\",
    "\n", " ", "\t", "<|python_tag|>", EOT, EOM, _ASSISTANT_HEADER, ".call(query=", '"x")', "brave_search",
    "wolfram_alpha", "photogen", "code_interpreter", "f", "x", "x=", "1", "-1.5", "None", "True", "**", "lambda",
    '{"name": "f", "parameters": {"a": 1}}', '"type": "function"', '"name"', '"parameters"', "[f(x=1)]",
    'brave_search.call(query="q")', "é", "🦙", "\x00"
]  # fmt: skip
fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4))
answers = st.lists(fragment, max_size=40).map("".join)


def content_without_calls(text: str) -> tuple:
    """The content and stop reason of an answer that calls no tool, by the documented rules (tools.md)."""
    text = text.strip(" ")
    text = text[len(_ASSISTANT_HEADER) :] if text.startswith(_ASSISTANT_HEADER) else text
    text = text[len(PYTHON_TAG) :] if text.startswith(PYTHON_TAG) else text
    for end, reason in ((EOT, "end_of_turn"), (EOM, "end_of_message")):
        if text.endswith(end):
            return text[: -len(end)], reason
    return text, None


@given(text=answers, stop_reason=st.sampled_from(STOP_REASONS))
def test_fuzz_any_answer_is_read(tok, text, stop_reason):
    message = ChatFormat(tok).decode_assistant_message_from_content(text, stop_reason)
    assert set(message) == {"role", "content", "stop_reason", "tool_calls"} and message["role"] == "assistant"
    content, found_reason = content_without_calls(text)
    assert message["stop_reason"] == (found_reason or stop_reason)
    if message["tool_calls"]:
        assert message["content"] == ""
        for call in message["tool_calls"]:
            assert isinstance(call["tool_name"], str) and call["tool_name"]
            assert isinstance(call["arguments"], dict)
            assert isinstance(call["call_id"], str) and call["call_id"]
    else:
        assert message["content"] == content  # nothing of the model's text is lost


# The syntax of calls, from which backtracking patterns build their worst cases.
CALL_SYNTAX = [
    "<function=", "<function=f>", ">", ">{", "{", "}", "\n", "x", "[", "f(", "x=", "'", '"', ".call(query=",
    "<|python_tag|>", "-"
]  # fmt: skip


@given(unit=st.lists(st.sampled_from(CALL_SYNTAX), min_size=1, max_size=4).map("".join))
def test_fuzz_repeated_fragments_are_read_quickly(tok, unit):
    text = unit * (20_000 // len(unit) + 1)  # a backtracking parser takes seconds to hours on such text
    start = time.perf_counter()
    message = ChatFormat(tok).decode_assistant_message_from_content(text, "length")
    assert time.perf_counter() - start < 3.0
    assert message["tool_calls"] or message["content"] == content_without_calls(text)[0]


# llama-models' pattern for <function=name>{...}, which backtracks; ours reads the same in one pass.
LLAMA_MODELS_FUNCTION_TAG = re.compile(r"<function=(?P<function_name>[^}]+)>(?P<args>{.*?})")


@given(
    text=st.lists(
        st.sampled_from(["<function=", "<function=f>", ">", "{", "}", ">{", "\n", "x", "<", "="]), max_size=30
    ).map("".join)
)
def test_fuzz_function_tag_finds_what_llama_models_pattern_finds(text):
    match = LLAMA_MODELS_FUNCTION_TAG.search(text)
    expected = (match["function_name"], match.start("args"), match.end("args")) if match else None
    assert _function_tag(text) == expected


# Writing calls and reading them back --------------------------------------------------------------------------

names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True).filter(
    lambda name: name not in BUILTIN_TOOLS and not keyword.iskeyword(name)
)
# Text that no form of call can hold as it is: llama-models writes Python strings unescaped, and a "<" or ">" could
# start or end a <function=...> call inside the arguments.
plain_text = st.text(st.characters(exclude_characters='"\\<>\n\r\x00', exclude_categories=("Cs",)), max_size=12)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), plain_text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(plain_text, inner, max_size=3)),
    max_leaves=8,
)
# The "python_list" format writes a dict as {key=value}, which is not Python; lists of scalars only then.
python_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=8)


@st.composite
def custom_calls(draw, tool_prompt_format: str) -> dict:
    values = python_values if tool_prompt_format == "python_list" else json_values
    arguments = draw(st.dictionaries(names, values, max_size=4))
    return {"tool_name": draw(names), "arguments": arguments}


@pytest.mark.parametrize("tool_prompt_format", TOOL_PROMPT_FORMATS)
@given(data=st.data())
def test_fuzz_a_written_call_is_read_back(tok, tool_prompt_format, data):
    call = data.draw(custom_calls(tool_prompt_format))
    chat = ChatFormat(tok, tool_prompt_format=tool_prompt_format)
    header = chat.encode_header({"role": "assistant", "content": ""})
    tokens = chat.encode_message({"role": "assistant", "content": "", "tool_calls": [call]})
    assert tokens[: len(header)] == header
    message = chat.decode_assistant_message(tokens[len(header) :], "length")  # as the model would write it
    assert [(c["tool_name"], c["arguments"]) for c in message["tool_calls"]] == [(call["tool_name"], call["arguments"])]
    assert message["stop_reason"] == "end_of_turn" and message["content"] == ""


@given(tool=st.sampled_from(["brave_search", "wolfram_alpha", "photogen"]), query=plain_text)
def test_fuzz_a_written_builtin_call_is_read_back(tok, tool, query):
    chat = ChatFormat(tok)
    header = chat.encode_header({"role": "assistant", "content": ""})
    call = {"tool_name": tool, "arguments": {"query": query}}
    message = {"role": "assistant", "content": "", "tool_calls": [call], "stop_reason": "end_of_message"}
    tokens = chat.encode_message(message)
    message = chat.decode_assistant_message(tokens[len(header) :], "length")
    assert [(c["tool_name"], c["arguments"]) for c in message["tool_calls"]] == [(tool, {"query": query})]
    assert message["stop_reason"] == "end_of_message"


# Writing dialogs ----------------------------------------------------------------------------------------------

hashable_junk = st.one_of(
    st.none(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.frozensets(st.integers(), max_size=2),
)


def nested_list(depth: int) -> list:
    items = []
    for _ in range(depth):
        items = [items]
    return items


def circular_list() -> list:
    items = [1]
    items.append(items)
    return items


def circular_dict() -> dict:
    items = {"a": 1}
    items["self"] = items
    return items


# Values no JSON or Python literal holds, and values that overflow a recursive writer.
oddities = st.one_of(
    st.builds(circular_list),
    st.builds(circular_dict),
    st.builds(object),
    st.builds(nested_list, st.just(5_000)),
    st.builds(pow, st.just(10), st.just(5000)),
    st.sampled_from([float("nan"), 1j]),
)
junk = st.one_of(hashable_junk, st.lists(st.integers(), max_size=2), oddities)
anything = st.recursive(
    junk,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=10,
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "ipython", "tool"]), junk)
tool_calls = st.one_of(
    anything,
    st.lists(
        st.one_of(
            anything,
            st.fixed_dictionaries(
                {
                    "tool_name": st.one_of(names, st.sampled_from(BUILTIN_TOOLS), junk),
                    "arguments": st.one_of(st.dictionaries(st.text(max_size=4), anything, max_size=3), junk),
                },
                optional={"call_id": anything},
            ),
        ),
        max_size=3,
    ),
)
messages = st.one_of(
    junk,
    st.fixed_dictionaries(
        {"role": roles, "content": st.one_of(st.text(max_size=30), answers, junk)},
        optional={"tool_calls": tool_calls, "stop_reason": st.one_of(st.sampled_from(STOP_REASONS), junk)},
    ),
)
dialogs = st.one_of(st.lists(messages, max_size=4), junk, messages)


@pytest.mark.parametrize("tool_prompt_format", TOOL_PROMPT_FORMATS)
@given(dialog=dialogs, strip_content=st.booleans())
def test_fuzz_any_dialog_is_written_or_refused(tok, tok3, tool_prompt_format, dialog, strip_content):
    for tokenizer in (tok, tok3):
        chat = ChatFormat(tokenizer, tool_prompt_format=tool_prompt_format, strip_content=strip_content)
        tokens = []
        if not raises_a_clear_value_error(lambda: tokens.extend(chat.encode_dialog_prompt(dialog))):
            assert tokens and all(isinstance(t, int) and 0 <= t < tokenizer.n_words for t in tokens)


plain_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.one_of(st.text(max_size=30), answers)}
)


@given(dialog=st.lists(plain_messages, max_size=4))
def test_fuzz_a_plain_dialog_reads_back_as_written(tok, dialog):
    tokens = ChatFormat(tok).encode_dialog_prompt(dialog)
    expected = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}{EOT}" for m in dialog
    )
    assert tok.decode(tokens) == expected + "<|start_header_id|>assistant<|end_header_id|>\n\n"


# The tools module ---------------------------------------------------------------------------------------------

parameters = st.one_of(
    anything,
    st.dictionaries(
        st.one_of(names, hashable_junk),
        st.one_of(
            anything,
            st.fixed_dictionaries(
                {
                    "param_type": st.one_of(st.sampled_from(["str", "int", "float", "bool", "list", "dict"]), junk),
                    "description": st.one_of(plain_text, junk),
                },
                optional={"required": st.one_of(st.booleans(), junk), "default": anything},
            ),
        ),
        max_size=3,
    ),
)
definitions = st.one_of(
    anything,
    st.fixed_dictionaries(
        {"name": st.one_of(names, junk), "description": st.one_of(plain_text, junk)},
        optional={"parameters": parameters},
    ),
)


@given(
    tools=st.one_of(st.lists(definitions, max_size=3), definitions),
    builtin=st.one_of(st.lists(st.one_of(st.sampled_from(BUILTIN_TOOLS), junk), max_size=2), junk),
    tool_format=st.one_of(st.sampled_from(TOOL_PROMPT_FORMATS), junk),
    instruction=st.one_of(st.none(), plain_text, junk),
)
def test_fuzz_tool_prompts_are_written_or_refused(tools, builtin, tool_format, instruction):
    for build in (
        lambda: json_tools_prompt(tools),
        lambda: function_tag_tools_prompt(tools),
        lambda: python_list_tools_prompt(tools, instruction),
        lambda: system_prompt(builtin, instruction=instruction, today="21 September 2024"),
        lambda: tool_messages(tools, builtin, tool_format=tool_format, instruction=instruction, today="x"),
    ):
        raises_a_clear_value_error(build)


@given(name=st.one_of(names, junk), description=st.one_of(plain_text, junk), parameters=parameters)
def test_fuzz_a_tool_is_made_or_refused(name, description, parameters):
    made = []
    if not raises_a_clear_value_error(lambda: made.append(Tool(name, description, echo, parameters))):
        assert made[0].definition() == {"name": name, "description": description, "parameters": parameters}
        json_tools_prompt(made)  # a Tool that could be made can be offered in every format
        function_tag_tools_prompt(made)
        python_list_tools_prompt(made)


def echo(**kwargs):
    return kwargs


TOOLS = [
    Tool(
        "echo",
        "Returns its arguments",
        echo,
        {
            "text": {"param_type": "str", "description": "a text"},
            "n": {"param_type": "int", "description": "a number", "required": False},
            "x": {"param_type": "float", "description": "a real", "required": False},
            "flag": {"param_type": "bool", "description": "a flag", "required": False},
            "items": {"param_type": "list", "description": "a list", "required": False},
            "opts": {"param_type": "dict", "description": "a dict", "required": False},
        },
    ),
    Tool(
        "odd",
        "Returns what it is given, JSON or not",
        lambda value: value,
        {"value": {"param_type": "list", "description": "anything"}},
    ),
]


argument_names = st.sampled_from(["text", "n", "x", "flag", "items", "opts", "value", "y"])
calls = st.one_of(
    anything,
    st.fixed_dictionaries(
        {
            "tool_name": st.one_of(st.sampled_from(["echo", "odd", "missing"]), junk),
            "arguments": st.one_of(st.dictionaries(argument_names, anything, max_size=4), anything),
        }
    ),
)


@given(call=calls)
def test_fuzz_run_tool_call_always_answers(call):
    answer = run_tool_call(call, TOOLS)  # never raises, whatever the model sent
    assert isinstance(answer, str)
    if not answer.startswith("Error: "):
        assert call["tool_name"] in ("echo", "odd")


@given(text=st.text(max_size=40))
def test_fuzz_a_str_argument_reaches_the_tool_as_it_is(text):
    assert run_tool_call({"tool_name": "echo", "arguments": {"text": text}}, TOOLS) == json.dumps(
        {"text": text}, ensure_ascii=False
    )
