"""Tool calling (Llama 3.1+): tool calls written into prompts token for token as llama-models writes them, read back
out of answers by llama-models' rules, the prompts of Meta's prompt-format documents byte for byte, completions
that carry the calls, and the loop that runs registered tools.

Token-for-token expectations are built by hand from the documented rules (each piece encoded on its own, plus the
special tokens' IDs) and, where llama-models is installed (requirements-test.txt pins it), checked against its own
`ChatFormat` too. The documents' examples are in prompt_format_examples.py.
"""

import importlib.util
import json
import random
import string
import time
from datetime import date
from pathlib import Path

import prompt_format_examples as docs
import pytest
from helpers import ScriptedModel, skip_or_fail

from llama import ChatFormat, Llama, Tokenizer
from llama.text.answers import assistant_message
from llama.tokenizer import stop_reason
from llama.tools import (
    Tool,
    chat_with_tools,
    function_tag_tools_prompt,
    json_tools_prompt,
    python_list_tools_prompt,
    run_tool_call,
    system_prompt,
    tool_messages,
)

ROOT = Path(__file__).resolve().parent.parent

# Special-token IDs (Llama 3.1 names; the same IDs as Llama 3's).
BEGIN, START, END, EOM, EOT, PYTHON_TAG = 128000, 128006, 128007, 128008, 128009, 128010


@pytest.fixture(scope="module")
def tok(tokenizer_path) -> Tokenizer:
    return Tokenizer(tokenizer_path, version="3.1")


def enc(tok: Tokenizer, text: str) -> list:
    """`text` tokenized on its own, as llama-models tokenizes each piece of a message."""
    return tok.encode(text, bos=False, eos=False)


def header(tok: Tokenizer, role: str) -> list:
    return [START] + enc(tok, role) + [END] + enc(tok, "\n\n")


def calls_of(message) -> list:
    """A message's tool calls without their (random) call IDs."""
    return [(call["tool_name"], call["arguments"]) for call in message.get("tool_calls") or []]


def assistant(content="", calls=(), stop_reason=None) -> dict:
    tool_calls = [{"tool_name": name, "arguments": arguments} for name, arguments in calls]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    if stop_reason is not None:
        message["stop_reason"] = stop_reason
    return message


# Writing tool calls: token for token, by the rules ------------------------------------------------------------


def test_special_tokens_of_tool_calling(tok):
    names = {"<|begin_of_text|>": BEGIN, "<|start_header_id|>": START, "<|end_header_id|>": END,
             "<|eom_id|>": EOM, "<|eot_id|>": EOT, "<|python_tag|>": PYTHON_TAG}  # fmt: skip
    assert {name: tok.special_tokens[name] for name in names} == names


def test_each_stop_token_gives_its_stop_reason(tokenizer_path, tok):
    assert stop_reason(tok, EOT) == "end_of_turn"
    assert stop_reason(tok, EOM) == "end_of_message"  # a tool call awaits its result
    assert stop_reason(tok, tok.eos_id) == "end_of_turn"  # <|end_of_text|>, how a base model ends
    assert stop_reason(tok, PYTHON_TAG) is None and stop_reason(tok, enc(tok, "Done")[0]) is None
    llama3 = Tokenizer(tokenizer_path, version="3")  # no <|eom_id|>: its ID is a reserved token there
    assert stop_reason(llama3, EOT) == "end_of_turn" and stop_reason(llama3, EOM) is None


@pytest.mark.parametrize("tool", ["brave_search", "wolfram_alpha", "photogen"])
def test_a_builtin_search_call_is_name_dot_call(tok, tool):
    message = assistant(calls=[(tool, {"query": "latest price of 1oz gold"})], stop_reason="end_of_message")
    assert ChatFormat(tok).encode_message(message) == (
        header(tok, "assistant")
        + enc(tok, f'{tool}.call(query="latest price of 1oz gold")')  # the call, on its own
        + [EOM]  # stop_reason end_of_message: the model awaits the tool's output
    )


def test_a_code_interpreter_call_is_its_code_after_python_tag(tok):
    code = "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n\nprint(is_prime(7))"
    message = assistant("Let me compute that.", [("code_interpreter", {"code": code})], "end_of_message")
    assert ChatFormat(tok).encode_message(message) == (
        header(tok, "assistant")
        + [PYTHON_TAG]  # the first call is the code interpreter's
        + enc(tok, "Let me compute that.")  # the content
        + enc(tok, code)  # the code as it is, not stripped
        + [EOM]
    )


@pytest.mark.parametrize(
    "tool_prompt_format, text",
    [
        (
            "json",
            '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "days": 3, "hourly": false}}',
        ),
        ("function_tag", '<function=get_weather>{"city": "Paris", "days": 3, "hourly": false}</function>'),
        ("python_list", '[get_weather(city="Paris", days=3, hourly=False)]'),
    ],
)
def test_a_custom_call_in_each_format(tok, tool_prompt_format, text):
    message = assistant(calls=[("get_weather", {"city": "Paris", "days": 3, "hourly": False})])
    assert ChatFormat(tok, tool_prompt_format=tool_prompt_format).encode_message(message) == (
        header(tok, "assistant") + enc(tok, text) + [EOT]  # no stop_reason: <|eot_id|>
    )


def test_content_and_each_call_are_tokenized_on_their_own(tok):
    calls = [("brave_search", {"query": "gold"}), ("get_price", {"metal": "gold"})]
    message = assistant("Let me check.", calls, "end_of_turn")
    search = 'brave_search.call(query="gold")'
    custom = '{"type": "function", "name": "get_price", "parameters": {"metal": "gold"}}'
    pieces = enc(tok, "Let me check.") + enc(tok, search) + enc(tok, custom)
    assert ChatFormat(tok).encode_message(message) == header(tok, "assistant") + pieces + [EOT]
    # The boundaries matter: the text tokenized whole splits differently (".brave" is one pre-token).
    assert pieces != enc(tok, "Let me check." + search + custom)


def test_python_tag_only_when_the_first_call_is_the_code_interpreter(tok):
    chat = ChatFormat(tok)
    code_first = assistant(calls=[("code_interpreter", {"code": "print(1)"}), ("brave_search", {"query": "x"})])
    search_first = assistant(calls=[("brave_search", {"query": "x"}), ("code_interpreter", {"code": "print(1)"})])
    body = enc(tok, "print(1)") + enc(tok, 'brave_search.call(query="x")')
    assert chat.encode_message(code_first) == header(tok, "assistant") + [PYTHON_TAG] + body + [EOT]
    body = enc(tok, 'brave_search.call(query="x")') + enc(tok, "print(1)")
    assert chat.encode_message(search_first) == header(tok, "assistant") + body + [EOT]


@pytest.mark.parametrize(
    "stop_reason, last", [(None, EOT), ("end_of_turn", EOT), ("length", EOT), ("end_of_message", EOM)]
)
def test_stop_reason_picks_the_last_token(tok, stop_reason, last):
    message = {"role": "assistant", "content": "Done."}
    if stop_reason:
        message["stop_reason"] = stop_reason
    assert ChatFormat(tok).encode_message(message) == header(tok, "assistant") + enc(tok, "Done.") + [last]


def test_tool_role_is_written_as_ipython(tok):
    chat = ChatFormat(tok)
    expected = header(tok, "ipython") + enc(tok, '"25 C"') + [EOT]  # "ipython" is two tokens, "ipy" "thon"
    assert chat.encode_message({"role": "tool", "content": '"25 C"'}) == expected
    assert chat.encode_message({"role": "ipython", "content": '"25 C"'}) == expected


def test_a_tool_dialog_token_for_token(tok):
    dialog = [
        {"role": "system", "content": "Environment: ipython"},
        {"role": "user", "content": "What is 2**10?"},
        assistant(calls=[("code_interpreter", {"code": "print(2**10)"})], stop_reason="end_of_message"),
        {"role": "tool", "content": "1024"},
    ]
    assert ChatFormat(tok).encode_dialog_prompt(dialog) == (
        [BEGIN]
        + header(tok, "system") + enc(tok, "Environment: ipython") + [EOT]
        + header(tok, "user") + enc(tok, "What is 2**10?") + [EOT]
        + header(tok, "assistant") + [PYTHON_TAG] + enc(tok, "print(2**10)") + [EOM]
        + header(tok, "ipython") + enc(tok, "1024") + [EOT]
        + header(tok, "assistant")  # the model's turn
    )  # fmt: skip


def test_dialogs_without_tool_keys_encode_as_before(tok):
    dialog = [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Hi! "}]
    expected = [BEGIN] + header(tok, "system") + enc(tok, "Be brief.") + [EOT] + header(tok, "user") + enc(tok, "Hi!")
    assert ChatFormat(tok).encode_dialog_prompt(dialog) == expected + [EOT] + header(tok, "assistant")
    # llama-models' way: content as given
    kept = [BEGIN] + header(tok, "system") + enc(tok, "  Be brief.\n") + [EOT] + header(tok, "user") + enc(tok, "Hi! ")
    assert ChatFormat(tok, strip_content=False).encode_dialog_prompt(dialog) == kept + [EOT] + header(tok, "assistant")


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}, "non-empty str"),
        ({"role": "assistant", "content": "", "tool_calls": [{"tool_name": "", "arguments": {}}]}, "non-empty str"),
        ({"role": "assistant", "content": "", "tool_calls": [{"tool_name": "f"}]}, "'arguments' that is a dict"),
        ({"role": "assistant", "content": "", "tool_calls": [{"tool_name": "f", "arguments": [1]}]}, "is a dict"),
        ({"role": "assistant", "content": "", "tool_calls": ["f()"]}, "must be a dict"),
        ({"role": "assistant", "content": "", "tool_calls": {"tool_name": "f"}}, "must be a list"),
        ({"role": "assistant", "content": "", "tool_calls": [{"tool_name": "brave_search", "arguments": {}}]}, "query"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"tool_name": "code_interpreter", "arguments": {}}]},
            "code",
        ),
        ({"role": "assistant", "content": "", "tool_calls": [{"tool_name": "f", "arguments": {"x": {1}}}]}, "JSON"),
        ({"role": "assistant", "content": "", "stop_reason": "done"}, "'stop_reason' must be one of"),
        ({"role": "user", "content": "", "tool_calls": [{"tool_name": "f", "arguments": {}}]}, "Only assistant"),
        ({"role": "tool", "content": "", "stop_reason": "end_of_turn"}, "Only assistant"),
    ],
)
def test_malformed_tool_fields_are_value_errors(tok, message, error):
    with pytest.raises(ValueError, match=error):
        ChatFormat(tok).encode_dialog_prompt([message])


def test_tool_calling_needs_llama31_tokens(tokenizer_path):
    chat = ChatFormat(Tokenizer(tokenizer_path))  # Llama 3: no <|python_tag|>, no <|eom_id|>
    for message in (
        assistant(calls=[("f", {})]),
        {"role": "assistant", "content": "", "stop_reason": "end_of_message"},
        {"role": "tool", "content": "1"},
    ):
        with pytest.raises(ValueError, match='version="3.1"'):
            chat.encode_message(message)
    assert chat.encode_message(assistant("Hi", stop_reason="end_of_turn"))[-1] == EOT  # fine: nothing new


def test_unknown_tool_prompt_format_is_refused(tok):
    with pytest.raises(ValueError, match="tool_prompt_format"):
        ChatFormat(tok, tool_prompt_format="xml")


# Reading tool calls back --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, calls, stop_reason",
    [
        (docs.LLAMA31_BUILTIN_TOOLS_RESPONSE, [("brave_search", {"query": "latest price of 1oz gold"})],
         "end_of_message"),
        (docs.LLAMA31_CODE_INTERPRETER_RESPONSE,
         [("code_interpreter", {"code": docs.LLAMA31_CODE_INTERPRETER_RESPONSE[14:-10]})], "end_of_message"),
        (docs.LLAMA31_JSON_TOOLS_RESPONSE, [("trending_songs", {"n": "10", "genre": "all"})], "end_of_message"),
        (docs.LLAMA31_FUNCTION_TAG_TOOLS_RESPONSE, [("trending_songs", {"n": 10})], "end_of_turn"),
        (docs.LLAMA31_FULL_INTERACTION_RESPONSE, [], "end_of_turn"),
        (docs.LLAMA32_PYTHON_LIST_TOOLS_RESPONSE, [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
                                                   ("get_weather", {"city": "Seattle", "metric": "celsius"})],
         "end_of_turn"),
        (docs.LLAMA32_TOOLS_IN_USER_MESSAGE_RESPONSE, [("get_user_info", {"user_id": 7890, "special": "black"})],
         "end_of_turn"),
        (docs.LLAMA32_CODE_INTERPRETER_RESPONSE,
         [("code_interpreter", {"code": docs.LLAMA32_CODE_INTERPRETER_RESPONSE[14:-10]})], "end_of_message"),
    ],
)  # fmt: skip
def test_the_documents_answers_are_read(tok, response, calls, stop_reason):
    tokens = tok.encode(response, bos=False, eos=False, allowed_special="all")  # as the model wrote them
    message = ChatFormat(tok).decode_assistant_message(tokens, "length")
    assert calls_of(message) == calls
    assert message["stop_reason"] == stop_reason  # from the final <|eot_id|> / <|eom_id|>
    assert message["content"] == ("" if calls else response[: -len("<|eot_id|>")])
    assert all(isinstance(call["call_id"], str) and call["call_id"] for call in message["tool_calls"])
    # The decoder cuts the stop token off; the stop reason it found is then given instead.
    assert calls_of(ChatFormat(tok).decode_assistant_message(tokens[:-1], stop_reason)) == calls


@pytest.mark.parametrize(
    "text, calls",
    [
        ("Paris is sunny today.", []),
        ('  {"name": "get_weather", "parameters": {"city": "Paris"}}  ', [("get_weather", {"city": "Paris"})]),
        ('{"type": "function", "name": "f", "parameters": {}}', [("f", {})]),
        ('{"name": "brave_search", "parameters": {"q": "gold price"}}', [("brave_search", {"query": "gold price"})]),
        ("[wolfram_alpha(question='2+2')]", [("wolfram_alpha", {"query": "2+2"})]),
        ('I will search: brave_search.call(query="gold") now', [("brave_search", {"query": "gold"})]),
        ('my_tool.call(query="x")', [("my_tool", {"query": "x"})]),  # any name, as llama-models reads it
        ('<function=f>{"a": {"b": [1, 2]}}</function>', [("f", {"a": {"b": [1, 2]}})]),  # nested object
        ("<function=f>{'a': 'b'}</function>", [("f", {"a": "b"})]),  # single quotes, as llama-models accepts
        ('<function=f>{"note": "it\'s"}</function>', [("f", {"note": "it's"})]),
        ("[f(a=1, b=[1, 'x'], c={'k': None}, d=-2.5, e=True)]",
         [("f", {"a": 1, "b": [1, "x"], "c": {"k": None}, "d": -2.5, "e": True})]),
        ("[f(), g(x=(1, 2))]", [("f", {}), ("g", {"x": [1, 2]})]),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n[f(x=1)]", [("f", {"x": 1})]),
        # Not well-formed calls: they stay content.
        ('{"type": "function", "name": "f"}', []),
        ('{"name": "f", "parameters": [1]}', []),
        ('{"name": 3, "parameters": {}}', []),
        ('{"a": 1}', []),
        ('{"name": "f", "parameters": ', []),
        ("[]", []),
        ("[f(1)]", []),
        ("[f(x=y)]", []),
        ("[f(**kw)]", []),
        ("[f(x={1, 2})]", []),
        ("[f(x=1), 2]", []),
        ("[obj.f(x=1)]", []),
        ("[f(x=1)] and more", []),
        ("[brave_search()]", []),
        ("<function=f>{not json}</function>", []),
        ("[__import__('os').system('ls')]", []),
        ("x" * 10_000, []),
        ("[" * 5_000, []),
        ('{"a": ' * 5_000, []),
    ],
)  # fmt: skip
def test_parsing_rules(tok, text, calls):
    message = ChatFormat(tok).decode_assistant_message_from_content(text, "end_of_turn")
    assert calls_of(message) == calls
    if not calls:
        assert message["content"] == text.strip(" ")
    assert set(message) == {"role", "content", "stop_reason", "tool_calls"}


def test_python_tag_text_that_is_no_other_call_is_code(tok):
    message = ChatFormat(tok).decode_assistant_message_from_content("<|python_tag|>print(42)", "end_of_message")
    assert calls_of(message) == [("code_interpreter", {"code": "print(42)"})]
    assert message["content"] == ""


def test_reading_never_raises(tok):
    chat = ChatFormat(tok)
    pieces = ['{"name": "f", "parameters": {"x": 1}}', "[f(x=1, y='a')]", '<function=f>{"x": {"y": 1}}</function>',
              'brave_search.call(query="q")', "<|python_tag|>", "<|eom_id|>", "'", '"', "\\", "{", "}", "[", "]", "(",
              ")", "=", ",", ":", "\n", " ", "\x00", "é", "🦙"]  # fmt: skip
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces + list(string.printable)) for _ in range(rng.randint(0, 30)))
        message = chat.decode_assistant_message_from_content(text, rng.choice(["end_of_turn", "length"]))
        assert isinstance(message["content"], str)
        assert isinstance(message["tool_calls"], list)


# Answers built to make a backtracking parser hang. The pattern this library used to read <function=...> with (it is
# llama-models') took 6 s on 800 repeats of "<function=x>{" and grew with the cube of the length: the first shape
# would take over half an hour; the quadratic ones (1 MB each) several minutes. Read in linear time, each takes
# milliseconds; the bound only catches a return of the backtracking. benchmarks/hostile_parsing.py times more shapes.
HOSTILE_ANSWERS = [
    ("<function=x>{" * 5_000, []),
    ("<function=" * 100_000, []),
    ("<function=" + ">{" * 500_000, []),
    ("<function=x>{\n" * 70_000 + "}", []),
    ("<|python_tag|>" + "<function=x>{" * 5_000, [("code_interpreter", {"code": "<function=x>{" * 5_000})]),
    ('x.call(query="' * 70_000, []),
]


@pytest.mark.parametrize("text, calls", HOSTILE_ANSWERS, ids=["brace", "tag", "tag_brace", "newlines", "python_tag",
                                                              "builtin"])  # fmt: skip
def test_hostile_answers_are_read_in_linear_time(tok, text, calls):
    start = time.perf_counter()
    message = ChatFormat(tok).decode_assistant_message_from_content(text, "end_of_turn")
    assert time.perf_counter() - start < 3.0
    assert calls_of(message) == calls
    assert message["content"] == ("" if calls else text)


def test_a_function_tag_is_found_after_hostile_text(tok):
    text = "<function=" * 50_000 + "} " + '<function=get_weather>{"city": "Paris"}</function>'
    start = time.perf_counter()
    message = ChatFormat(tok).decode_assistant_message_from_content(text, "end_of_turn")
    assert time.perf_counter() - start < 3.0
    # No <function= before the first "}" has a ">{" to open its arguments; the call after it is read.
    assert calls_of(message) == [("get_weather", {"city": "Paris"})]


def test_call_ids_are_fresh(tok):
    chat = ChatFormat(tok)
    first = chat.decode_assistant_message_from_content("[f(), g()]", "end_of_turn")["tool_calls"]
    second = chat.decode_assistant_message_from_content("[f(), g()]", "end_of_turn")["tool_calls"]
    assert len({call["call_id"] for call in first + second}) == 4


def test_an_unknown_stop_reason_is_refused(tok):
    with pytest.raises(ValueError, match="stop_reason"):
        ChatFormat(tok).decode_assistant_message([], "out_of_tokens")


def test_a_parsed_call_writes_back_as_llama_models_writes_it(tok):
    chat = ChatFormat(tok, tool_prompt_format="python_list")
    message = chat.decode_assistant_message_from_content(docs.LLAMA32_PYTHON_LIST_TOOLS_RESPONSE, "length")
    weather = '[get_weather(city="San Francisco", metric="celsius")]'
    seattle = '[get_weather(city="Seattle", metric="celsius")]'
    assert chat.encode_message(message) == header(tok, "assistant") + enc(tok, weather) + enc(tok, seattle) + [EOT]


# Cross-check with llama-models itself -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta(tokenizer_path):
    """llama-models' ChatFormat and types, on our tokenizer file (it ships the same one)."""
    if importlib.util.find_spec("llama_models") is None:
        skip_or_fail("llama-models is not installed (pip install llama-models==0.3.0, as in requirements-test.txt)")
    from llama_models import datatypes
    from llama_models.llama3.chat_format import ChatFormat as MetaChatFormat
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer

    return MetaChatFormat(MetaTokenizer(Path(tokenizer_path))), datatypes


def meta_tokens(meta, dialog, tool_prompt_format="json"):
    chat, types = meta
    stop_reasons = {"end_of_turn": types.StopReason.end_of_turn, "end_of_message": types.StopReason.end_of_message,
                    "length": types.StopReason.out_of_tokens, None: None}  # fmt: skip
    messages = [
        types.RawMessage(
            role="tool" if m["role"] == "ipython" else m["role"],
            content=m["content"],
            stop_reason=stop_reasons[m.get("stop_reason")],
            tool_calls=[
                types.ToolCall(call_id=c.get("call_id", "1"), tool_name=c["tool_name"], arguments=c["arguments"])
                for c in m.get("tool_calls", [])
            ],  # fmt: skip
        )
        for m in dialog
    ]
    return chat.encode_dialog_prompt(messages, types.ToolPromptFormat(tool_prompt_format)).tokens


CROSS_CHECK_DIALOGS = [
    [  # the documents' full interaction, as llama-models builds it today
        {"role": "system", "content": "Environment: ipython\nTools: brave_search, wolfram_alpha\n"},
        {"role": "user", "content": "What is the 100th decimal of pi?"},
        assistant(calls=[("wolfram_alpha", {"query": "100th decimal of pi"})], stop_reason="end_of_message"),
        {"role": "tool", "content": '\n{"queryresult": {"success": true}}\n'},
    ],
    [
        {"role": "user", "content": "Weather in Paris and gold price?"},
        assistant(
            "Let me check.",
            [
                ("get_weather", {"city": "Paris", "days": 2, "hourly": True, "units": None}),
                ("brave_search", {"query": "gold price"}),
                ("get_weather", {"cities": ["Paris", "Lyon"], "opts": {"a": 1.5}}),
            ],
            "end_of_turn",
        ),  # fmt: skip
        {"role": "ipython", "content": "  sunny  "},
        {"role": "ipython", "content": "$2,650"},
        {"role": "assistant", "content": "Sunny; $2,650.", "stop_reason": "end_of_turn"},
        {"role": "user", "content": "Now plot it."},
        assistant(
            "",
            [
                ("code_interpreter", {"code": "\nimport matplotlib\nprint('é')\n"}),
                ("photogen", {"query": "a sunny Paris"}),
            ],
            "end_of_message",
        ),  # fmt: skip
        {"role": "tool", "content": "[stdout]\né\n[/stdout]"},
        {"role": "assistant", "content": "Cut short", "stop_reason": "length"},
    ],
]


@pytest.mark.parametrize("tool_prompt_format", ["json", "function_tag", "python_list"])
@pytest.mark.parametrize("dialog", CROSS_CHECK_DIALOGS)
def test_encoding_matches_llama_models(tok, meta, dialog, tool_prompt_format):
    ours = ChatFormat(tok, tool_prompt_format=tool_prompt_format, strip_content=False)
    assert ours.encode_dialog_prompt(dialog) == meta_tokens(meta, dialog, tool_prompt_format)
    # By default content is stripped (Meta's Llama 3 reference); the same tokens once it is stripped already.
    stripped = [{**m, "content": m["content"].strip()} for m in dialog]
    assert ChatFormat(tok, tool_prompt_format=tool_prompt_format).encode_dialog_prompt(dialog) == meta_tokens(
        meta, stripped, tool_prompt_format
    )


MATCHING_ANSWERS = [
    docs.LLAMA31_BUILTIN_TOOLS_RESPONSE, docs.LLAMA31_CODE_INTERPRETER_RESPONSE, docs.LLAMA31_JSON_TOOLS_RESPONSE,
    docs.LLAMA31_FUNCTION_TAG_TOOLS_RESPONSE, docs.LLAMA31_FULL_INTERACTION_RESPONSE,
    docs.LLAMA32_TOOLS_IN_USER_MESSAGE_RESPONSE, docs.LLAMA32_CODE_INTERPRETER_RESPONSE,
    "Plain words.", '{"name": "brave_search", "parameters": {"q": "gold"}}', "[photogen(prompt='a cat')]",
    'Sure. wolfram_alpha.call(query="2+2")', "<|python_tag|>x = 1<|eom_id|>", '{"a": 1}', "[f(1)]",
    "<function=f>{'a': 'b'}</function>", '<function=f>{"a": 1}</function><|eot_id|>', "  [f(a=[1, 2])]  ",
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>",
]  # fmt: skip


@pytest.mark.parametrize("text", MATCHING_ANSWERS)
def test_parsing_matches_llama_models(tok, meta, text):
    chat, types = meta
    theirs = chat.decode_assistant_message_from_content(text, types.StopReason.out_of_tokens)
    ours = ChatFormat(tok).decode_assistant_message_from_content(text, "length")
    their_calls = [(getattr(c.tool_name, "value", c.tool_name), c.arguments) for c in theirs.tool_calls]
    assert calls_of(ours) == their_calls
    assert ours["content"] == theirs.content
    assert ours["stop_reason"] == {"out_of_tokens": "length"}.get(theirs.stop_reason.value, theirs.stop_reason.value)


@pytest.mark.parametrize(
    "text, ours, theirs",
    [  # where llama-models keeps only the first call, or gives up on a well-formed one
        ("[f(x=1), g(y=2)]", [("f", {"x": 1}), ("g", {"y": 2})], [("f", {"x": 1})]),
        ('<function=f>{"a": {"b": 1}}</function>', [("f", {"a": {"b": 1}})], []),
        ('<function=f>{"note": "it\'s"}</function>', [("f", {"note": "it's"})], []),
    ],
)
def test_where_parsing_differs_from_llama_models(tok, meta, text, ours, theirs):
    chat, types = meta
    their_message = chat.decode_assistant_message_from_content(text, types.StopReason.end_of_turn)
    assert [(c.tool_name, c.arguments) for c in their_message.tool_calls] == theirs
    assert calls_of(ChatFormat(tok).decode_assistant_message_from_content(text, "end_of_turn")) == ours


# The documents' prompts, byte for byte ------------------------------------------------------------------------

TRENDING_SONGS = {
    "name": "trending_songs",
    "description": "Returns the trending songs on a Music site",
    "parameters": {
        "n": {"param_type": "int", "description": "The number of songs to return", "required": True},
        "genre": {"param_type": "str", "description": "The genre of the songs to return", "required": False},
    },
}
GET_WEATHER = {
    "name": "get_weather",
    "description": "Get weather info for places",
    "parameters": {
        "city": {"param_type": "string", "description": "The name of the city to get the weather for"},
        "metric": {
            "param_type": "string",
            "description": "The metric for weather. Options are: celsius, fahrenheit",
            "required": False,
            "default": "celsius",
        },
    },
}
HELPFUL = "You are a helpful assistant."


def render(chat: ChatFormat, dialog) -> str:
    return chat.tokenizer.decode(chat.encode_dialog_prompt(dialog))


def content_of(prompt: str, role: str, nth: int = 0) -> str:
    """The content of the `nth` message with `role` in a rendered prompt."""
    head = f"<|start_header_id|>{role}<|end_header_id|>\n\n"
    rest = prompt.split(head)[nth + 1]
    return rest[: min(i for i in (rest.find("<|eot_id|>"), rest.find("<|eom_id|>")) if i >= 0)]


def test_llama31_builtin_tools(tok):
    system = system_prompt(["code_interpreter", "brave_search", "wolfram_alpha"], instruction=HELPFUL,
                           today=date(2024, 9, 21))  # fmt: skip
    assert system == content_of(docs.LLAMA31_BUILTIN_TOOLS, "system")
    assert tool_messages(builtin_tools=["code_interpreter", "brave_search", "wolfram_alpha"], instruction=HELPFUL,
                         today=date(2024, 9, 21)) == [{"role": "system", "content": system}]  # fmt: skip
    dialog = [{"role": "system", "content": system},
              {"role": "user", "content": "Search the web for the latest price of 1oz gold?"}]  # fmt: skip
    assert render(ChatFormat(tok, strip_content=False), dialog) == docs.LLAMA31_BUILTIN_TOOLS
    # Stripped (the default), the system message loses its final newline, and only that.
    assert render(ChatFormat(tok), dialog) == docs.LLAMA31_BUILTIN_TOOLS.replace(f"{HELPFUL}\n<|eot", f"{HELPFUL}<|eot")


def test_llama31_plain_prompts(tok):
    dialog = [{"role": "system", "content": "You are a helpful assistant"},
              {"role": "user", "content": "Answer who are you in the form of jeopardy?"}]  # fmt: skip
    assert render(ChatFormat(tok), dialog) == docs.LLAMA31_CONVERSATION
    dialog = [{"role": "system", "content": "Environment: ipython"},
              {"role": "user", "content": "Write code to check if number is prime, use that to see if the number 7 "
                                          "is prime"}]  # fmt: skip
    assert render(ChatFormat(tok), dialog) == docs.LLAMA31_CODE_INTERPRETER


def test_llama31_full_interaction(tok):
    dialog = [
        {"role": "system", "content": "Environment: ipython\nTools: brave_search, wolfram_alpha\n"},
        {"role": "user", "content": "What is the 100th decimal of pi?"},
        assistant(calls=[("wolfram_alpha", {"query": "100th decimal of pi"})], stop_reason="end_of_message"),
        {"role": "tool", "content": content_of(docs.LLAMA31_FULL_INTERACTION, "ipython")},
    ]
    # The document was made by an older llama-models, which put <|python_tag|> before every built-in call; today's
    # (and this library) put it before code only.
    expected = docs.LLAMA31_FULL_INTERACTION.replace("<|python_tag|>wolfram_alpha", "wolfram_alpha")
    assert render(ChatFormat(tok, strip_content=False), dialog) == expected


@pytest.mark.parametrize(
    "tool_format, document, describe",
    [("json", docs.LLAMA31_JSON_TOOLS, json_tools_prompt),
     ("function_tag", docs.LLAMA31_FUNCTION_TAG_TOOLS, function_tag_tools_prompt)],
)  # fmt: skip
def test_llama31_custom_tools(tok, tool_format, document, describe):
    opening = tool_messages([TRENDING_SONGS], tool_format=tool_format, instruction=HELPFUL, today=date(2024, 9, 21))
    assert [m["role"] for m in opening] == ["system", "user"]
    assert opening[0]["content"] == content_of(document, "system")
    assert opening[1]["content"] == content_of(document, "user") == describe([TRENDING_SONGS])
    dialog = opening + [{"role": "user", "content": "Use tools to get latest trending songs"}]
    assert render(ChatFormat(tok, strip_content=False), dialog) == document


def test_llama31_json_definitions_are_json(tok):
    """Each tool's definition block is valid JSON, even with quotes in a description (llama-models' is not)."""
    parameters = {"x": {"param_type": "str", "description": "a\tb"}}
    tool = {"name": "q", "description": 'Say "hi"\\n', "parameters": parameters}
    text = json_tools_prompt([tool])
    block = text[text.index("{") : text.rindex("}") + 1]
    assert json.loads(block)["function"]["description"] == 'Say "hi"\\n'
    text = function_tag_tools_prompt([tool])
    line = next(line for line in text.splitlines() if line.startswith('{"name"'))
    assert json.loads(line)["parameters"] == {"x": {"description": "a\tb", "param_type": "str", "required": True}}


def test_llama32_python_list_tools(tok):
    opening = tool_messages([GET_WEATHER], tool_format="python_list")
    assert opening == [{"role": "system", "content": python_list_tools_prompt([GET_WEATHER])}]
    dialog = opening + [{"role": "user", "content": "What is the weather in SF and Seattle?"}]
    assert render(ChatFormat(tok), dialog) == docs.LLAMA32_PYTHON_LIST_TOOLS  # stripped or not: the same


def test_llama32_code_interpreter(tok):
    system = system_prompt(["code_interpreter"], today=date(2024, 9, 24))
    assert system == "Environment: ipython\n\nCutting Knowledge Date: December 2023\nToday Date: 24 September 2024\n"
    dialog = [{"role": "system", "content": system},
              {"role": "user", "content": "Write code to check if number is prime. Use it to verify if number 7 is "
                                          "prime"}]  # fmt: skip
    assert render(ChatFormat(tok, strip_content=False), dialog) == docs.LLAMA32_CODE_INTERPRETER


def test_llama32_python_list_round_trip(tok):
    dialog = tool_messages([GET_WEATHER], tool_format="python_list") + [
        {"role": "user", "content": "What is the weather in SF?"},
        assistant(calls=[("get_weather", {"city": "San Francisco", "metric": "celsius"})], stop_reason="end_of_turn"),
        {"role": "tool", "content": json.dumps("25 C")},
    ]
    # As in test_llama31_full_interaction: the document's <|python_tag|> came from an older llama-models.
    expected = docs.LLAMA32_PYTHON_LIST_E2E.replace("<|python_tag|>[get_weather", "[get_weather")
    assert render(ChatFormat(tok, tool_prompt_format="python_list"), dialog) == expected


def test_llama32_tools_in_a_user_message(tok):
    content = content_of(docs.LLAMA32_TOOLS_IN_USER_MESSAGE, "user")
    assert render(ChatFormat(tok), [{"role": "user", "content": content}]) == docs.LLAMA32_TOOLS_IN_USER_MESSAGE


def test_documents_as_shipped_by_llama_models(meta):
    """The examples in prompt_format_examples.py are the installed llama-models' documents, verbatim."""
    import llama_models

    shipped = Path(llama_models.__file__).parent
    text31 = (shipped / "llama3_1" / "prompt_format.md").read_text()
    text32 = (shipped / "llama3_2" / "text_prompt_format.md").read_text()
    for name in dir(docs):
        if name.startswith("LLAMA3"):
            assert f"```\n{getattr(docs, name)}\n```" in (text31 if name.startswith("LLAMA31") else text32), name


# The system prompt and definitions ----------------------------------------------------------------------------


def test_system_prompt_variants():
    cutoff = "Cutting Knowledge Date: December 2023\n"
    assert system_prompt(today=date(2025, 1, 5)) == cutoff + "Today Date: 05 January 2025\n"
    assert system_prompt(today="tomorrow", instruction="Be brief.") == cutoff + "Today Date: tomorrow\n\nBe brief.\n"
    assert system_prompt(environment=True, today="x") == "Environment: ipython\n\n" + cutoff + "Today Date: x\n"
    assert system_prompt(["wolfram_alpha"], today="x").startswith("Environment: ipython\nTools: wolfram_alpha\nCut")
    assert system_prompt().startswith(cutoff + f"Today Date: {date.today().day:02d} ")
    with pytest.raises(ValueError, match="not built-in tools"):
        system_prompt(["calculator"])
    with pytest.raises(ValueError, match="environment"):
        system_prompt(["brave_search"], environment=False)
    with pytest.raises(ValueError, match="today"):
        system_prompt(today=20240921)


def test_python_list_definitions():
    tool = {"name": "f", "description": "d", "parameters": {"a": {"param_type": "int", "description": "x",
                                                                  "required": False, "default": 0}}}  # fmt: skip
    text = python_list_tools_prompt([tool], preamble="Call functions.")
    assert text.startswith("Call functions.\n\nIf you decide to invoke any of the function(s)")
    listed = json.loads(text[text.index("\n[") :])
    assert listed == [
        {
            "name": "f",
            "description": "d",
            "parameters": {
                "type": "dict",
                "required": [],
                "properties": {"a": {"type": "int", "description": "x", "default": 0}},
            },
        }
    ]
    assert tool_messages([tool], tool_format="python_list", instruction="Call functions.")[0]["content"] == text


@pytest.mark.parametrize(
    "tools, error",
    [
        ({"name": "f", "description": "d", "parameters": {}}, "list of tools"),
        ([{"description": "d", "parameters": {}}], "'name'"),
        ([{"name": "f", "parameters": {}}], "'description'"),
        ([{"name": "f", "description": "d", "parameters": []}], "'parameters' must be a dict"),
        ([{"name": "f", "description": "d", "parameters": {"a": "int"}}], "param_type"),
        ([{"name": "f", "description": "d", "parameters": {"a": {"param_type": "int"}}}], "description"),
        ([{"name": "f", "description": "d", "parameters": {"a": {"type": "int", "description": "x"}}}], "unknown keys"),
        ([{"name": "f", "description": "d",
           "parameters": {"a": {"param_type": "int", "description": "x", "required": "no"}}}], "'required'"),
        (["f"], "Tool or a dict"),
    ],
)  # fmt: skip
def test_malformed_definitions_are_value_errors(tools, error):
    for describe in (json_tools_prompt, function_tag_tools_prompt, python_list_tools_prompt):
        with pytest.raises(ValueError, match=error):
            describe(tools)


def test_tool_messages_errors():
    with pytest.raises(ValueError, match="tool_format"):
        tool_messages([GET_WEATHER], tool_format="yaml")
    with pytest.raises(ValueError, match="custom tools only"):
        tool_messages([GET_WEATHER], ["brave_search"], tool_format="python_list")
    assert tool_messages(today="x") == [{"role": "system", "content": system_prompt(today="x")}]


# Completions carry the calls ----------------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "Gold price?"}]


def scripted_llama(tokenizer, answer: str, stop: int) -> Llama:
    """A Llama whose model writes `answer` (special tokens included) and then the `stop` token, after QUESTION."""
    script = tokenizer.encode(answer, bos=False, eos=False, allowed_special="all") + [stop]
    prompt_len = len(ChatFormat(tokenizer).encode_dialog_prompt(QUESTION))
    return Llama(ScriptedModel(script, tokenizer.n_words, prompt_len=prompt_len), tokenizer)


def test_chat_completion_returns_the_calls(tok):
    answer = '<|python_tag|>brave_search.call(query="gold price")'
    llama = scripted_llama(tok, answer, EOM)
    (result,) = llama.chat_completion([QUESTION], temperature=0, max_gen_len=30)
    assert result["stop_reason"] == "end_of_message"
    generation = result["generation"]
    assert list(generation) == ["role", "content", "stop_reason", "tool_calls"]
    assert calls_of(generation) == [("brave_search", {"query": "gold price"})]
    assert (generation["role"], generation["content"], generation["stop_reason"]) == ("assistant", "", "end_of_message")

    chunks = list(llama.chat_completion_stream([QUESTION], temperature=0, max_gen_len=30))
    assert "".join(chunk.text for chunk in chunks) == answer  # the text as the model wrote it
    assert [chunk.tool_calls for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert calls_of({"tool_calls": chunks[-1].tool_calls}) == calls_of(generation)
    assert chunks[-1].stop_reason == "end_of_message"

    # Appended to the dialog, the answer is written back as llama-models writes it (no python tag before a search).
    prompt = ChatFormat(tok).encode_dialog_prompt(QUESTION + [generation])
    assert prompt[-len(header(tok, "assistant")) - 1 :] == [EOM] + header(tok, "assistant")


def test_answers_without_calls_keep_the_reference_keys(tok, tokenizer_path):
    llama = scripted_llama(tok, "About $2,650 an ounce.", EOT)
    (result,) = llama.chat_completion([QUESTION], temperature=0, max_gen_len=30)
    assert result["generation"] == {"role": "assistant", "content": "About $2,650 an ounce."}
    assert set(result) == {"generation", "stop_reason"}

    llama3 = Tokenizer(tokenizer_path)  # Llama 3 tokens: answers are never read for calls
    answer = '{"name": "get_price", "parameters": {"metal": "gold"}}'
    llama = scripted_llama(llama3, answer, EOT)
    (result,) = llama.chat_completion([QUESTION], temperature=0, max_gen_len=30)
    assert result["generation"] == {"role": "assistant", "content": answer}
    chunks = list(llama.chat_completion_stream([QUESTION], temperature=0, max_gen_len=30))
    assert chunks[-1].finished and chunks[-1].tool_calls is None


def test_a_call_cut_short_is_still_read(tok):
    answer = "[get_price(metal='gold')]"
    llama = scripted_llama(tok, answer, EOT)
    n = len(enc(tok, answer))
    (result,) = llama.chat_completion([QUESTION], temperature=0, max_gen_len=n)  # no room for <|eot_id|>
    assert result["stop_reason"] == "length"
    assert calls_of(result["generation"]) == [("get_price", {"metal": "gold"})]
    assert result["generation"]["stop_reason"] == "length"


# Running tools ------------------------------------------------------------------------------------------------


def add(a: float, b: float = 0) -> float:
    return a + b


def fail(reason: str) -> str:
    raise RuntimeError(reason)


TOOLS = [
    Tool("add", "Add two numbers", add, {"a": {"param_type": "number", "description": "first"},
                                         "b": {"param_type": "number", "description": "second", "required": False}}),
    Tool("shout", "Upper-case a text", lambda text, times=1: text.upper() * times,
         {"text": {"param_type": "str", "description": "the text"},
          "times": {"param_type": "int", "description": "repeat", "required": False}}),
    Tool("fail", "Always fails", fail, {"reason": {"param_type": "str", "description": "why"}}),
    Tool("info", "Structured result", lambda flag: {"flag": flag, "items": [1, "é"]},
         {"flag": {"param_type": "bool", "description": "a flag"}}),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, arguments, output",
    [
        ("add", {"a": 2, "b": 3.5}, "5.5"),
        ("add", {"a": "2", "b": "1e3"}, "1002.0"),  # numbers quoted by the model are read as numbers
        ("shout", {"text": "hi", "times": "2"}, "HIHI"),
        ("info", {"flag": "true"}, '{"flag": true, "items": [1, "é"]}'),
        ("calculator", {"x": 1}, "Error: there is no tool named 'calculator'. The tools are: add, shout, fail, info."),
        ("code_interpreter", {"code": "import os"}, "Error: there is no tool named 'code_interpreter'. The tools are: "
                                                    "add, shout, fail, info."),
        ("add", {"a": 1, "c": 2}, "Error: add has no parameter 'c'. Its parameters are: a, b."),
        ("add", {"b": 1}, "Error: add needs the argument 'a'."),
        ("add", {"a": "two"}, "Error: the argument 'a' of add must be of type number, got 'two'."),
        ("add", {"a": True}, "Error: the argument 'a' of add must be of type number, got True."),
        ("add", {"a": "nan"}, "Error: the argument 'a' of add must be of type number, got 'nan'."),
        ("shout", {"text": 5}, "Error: the argument 'text' of shout must be of type str, got 5."),
        ("shout", {"text": "a", "times": 1.5}, "Error: the argument 'times' of shout must be of type int, got 1.5."),
        ("shout", {"text": "a", "times": 2.0}, "AA"),
        ("shout", {"text": "a", "times": " 3 "}, "AAA"),
        ("add", {"a": float("inf")}, "Error: the argument 'a' of add must be of type number, got inf."),
        ("info", {"flag": "yes"}, "Error: the argument 'flag' of info must be of type bool, got 'yes'."),
        ("info", {"flag": 1}, "Error: the argument 'flag' of info must be of type bool, got 1."),
        ("fail", {"reason": "no network"}, "Error: fail failed: RuntimeError: no network"),
        ("add", [1, 2], "Error: the arguments of add must be an object of named values, got [1, 2]."),
    ],
)  # fmt: skip
def test_run_tool_call(name, arguments, output):
    assert run_tool_call({"tool_name": name, "arguments": arguments}, TOOLS) == output


def test_run_tool_call_never_raises_on_what_the_model_sends():
    calls = (None, "add(1)", {}, {"tool_name": None}, {"tool_name": ["add"]}, {"tool_name": "add"},
             {"tool_name": "add", "arguments": None})  # fmt: skip
    for call in calls:
        assert run_tool_call(call, TOOLS).startswith("Error: ")


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"name": "get weather"}, "identifier"),
        ({"function": "add"}, "callable"),
        ({"parameters": {"a": {"param_type": "decimal", "description": "x"}}}, "cannot be checked"),
        ({"parameters": {"a": {"param_type": "int"}}}, "description"),
    ],
)
def test_malformed_tools_are_value_errors(kwargs, error):
    with pytest.raises(ValueError, match=error):
        Tool(**{"name": "f", "description": "d", "function": add, "parameters": {}, **kwargs})


def circular_list() -> list:
    items = [1]
    items.append(items)
    return items


def nested_list(depth: int) -> list:
    items = []
    for _ in range(depth):
        items = [items]
    return items


@pytest.mark.parametrize(
    "default", [object(), {1, 2}, b"bytes", float("nan"), float("inf"), circular_list(), nested_list(100_000)]
)
def test_a_default_that_is_not_json_is_refused_when_the_tool_is_made(default):
    param = {"param_type": "str", "description": "x", "default": default, "required": False}
    with pytest.raises(ValueError, match="parameter 'a': the default, a .*, cannot be written as JSON"):
        Tool("f", "d", add, {"a": param})
    for describe in (json_tools_prompt, function_tag_tools_prompt, python_list_tools_prompt):  # definitions too
        with pytest.raises(ValueError, match="cannot be written as JSON"):
            describe([{"name": "f", "description": "d", "parameters": {"a": param}}])


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for this")


@pytest.mark.parametrize("result", [circular_list(), {"a": Unprintable()}, nested_list(100_000)])
def test_a_result_that_cannot_be_written_comes_back_as_an_error(result):
    tool = Tool("odd", "Returns something JSON cannot hold", lambda: result)
    assert run_tool_call({"tool_name": "odd", "arguments": {}}, [tool]).startswith(
        "Error: the result of odd cannot be written as JSON: "
    )


def test_a_definition_without_parameters_has_none(tok):
    bare = {"name": "ping", "description": "Check the service"}
    empty = {**bare, "parameters": {}}
    for describe in (json_tools_prompt, function_tag_tools_prompt, python_list_tools_prompt):
        assert describe([bare]) == describe([empty])
        assert describe([bare]) == describe([Tool("ping", "Check the service", lambda: "pong")])
    for tool_format in ("json", "function_tag", "python_list"):
        assert tool_messages([bare], tool_format=tool_format, today="x") == tool_messages(
            [empty], tool_format=tool_format, today="x"
        )
    assert bare == {"name": "ping", "description": "Check the service"}  # the caller's dict is left as it is
    listed = json.loads(python_list_tools_prompt([bare]).split("\n\n")[-1])
    assert listed == [{**bare, "parameters": {"type": "dict", "required": [], "properties": {}}}]


@pytest.mark.parametrize(
    "tools, error",
    [
        ([TRENDING_SONGS], "Only Tool objects can be run, got a dict: a definition has no function to run"),
        ([TOOLS[0], "add"], "Only Tool objects can be run, got a str"),
        (TOOLS[0], "wrap a single tool in a list"),
        ({"add": TOOLS[0]}, "wrap a single tool in a list"),
        (None, "tools must be a list of tools, got NoneType"),
        ([TOOLS[0], Tool("add", "another add", add)], "Two tools are named 'add'"),
    ],
)
def test_run_tool_call_refuses_tools_it_cannot_run(tok, tools, error):
    with pytest.raises(ValueError, match=error):
        run_tool_call({"tool_name": "add", "arguments": {"a": 1}}, tools)
    generator = StandInGenerator(tok, ["Hello.<|eot_id|>"])
    with pytest.raises(ValueError, match=error):  # before the model is asked anything
        chat_with_tools(generator, QUESTION, tools)
    assert generator.prompts == []


class StandInGenerator:
    """Answers each `chat_completion` with the next of `answers` (what the model would write, special tokens
    included), read as `Llama.chat_completion` reads it; keeps every prompt it was given."""

    load_report = "Loaded in 0.01 seconds: a stand-in"  # what `Llama.build` would report

    def __init__(self, tokenizer, answers, tool_prompt_format="json"):
        self.tokenizer = tokenizer
        self.formatter = ChatFormat(tokenizer, tool_prompt_format=tool_prompt_format)
        self.answers = list(answers)
        self.prompts = []

    def chat_completion(self, dialogs, temperature=0.6, top_p=0.9, max_gen_len=None):
        results = []
        for dialog in dialogs:
            self.prompts.append(self.formatter.encode_dialog_prompt(dialog))
            tokens = self.tokenizer.encode(self.answers.pop(0), bos=False, eos=False, allowed_special="all")
            reason = {EOT: "end_of_turn", EOM: "end_of_message"}.get(tokens[-1], "length")
            tokens = tokens[:-1] if reason != "length" else tokens
            results.append({"generation": assistant_message(self.formatter, tokens, reason), "stop_reason": reason})
        return results


def test_the_loop_runs_calls_and_sends_results_back(tok):
    answers = ['<|python_tag|>{"type": "function", "name": "add", "parameters": {"a": 2, "b": 40}}<|eom_id|>',
               "The sum is 42.<|eot_id|>"]  # fmt: skip
    generator = StandInGenerator(tok, answers)
    opening = tool_messages(TOOLS, instruction=HELPFUL, today="x") + [{"role": "user", "content": "2 + 40?"}]
    dialog = chat_with_tools(generator, opening, TOOLS)
    assert dialog[: len(opening)] == opening and len(opening) == 3  # the dialog given is kept, not modified
    call, result, answer = dialog[len(opening) :]
    assert calls_of(call) == [("add", {"a": 2, "b": 40})] and call["stop_reason"] == "end_of_message"
    assert result == {"role": "ipython", "content": "42"}
    assert answer == {"role": "assistant", "content": "The sum is 42."}
    # The second prompt goes on from the first (which ends with the assistant's header) with the call, written
    # back as JSON, and the tool's output.
    call_text = '{"type": "function", "name": "add", "parameters": {"a": 2, "b": 40}}'
    expected_tail = enc(tok, call_text) + [EOM] + header(tok, "ipython") + enc(tok, "42") + [EOT]
    assert generator.prompts[1] == generator.prompts[0] + expected_tail + header(tok, "assistant")


def test_the_loop_runs_every_call_in_order_and_reports_errors(tok):
    answers = ["[add(a=1, b=2), shout(text='ok'), fail(reason='boom'), calculator(x=1)]<|eot_id|>",
               "Done.<|eot_id|>"]  # fmt: skip
    generator = StandInGenerator(tok, answers, tool_prompt_format="python_list")
    dialog = chat_with_tools(generator, [{"role": "user", "content": "Go"}], TOOLS)
    outputs = [m["content"] for m in dialog if m["role"] == "ipython"]
    unknown = "Error: there is no tool named 'calculator'. The tools are: add, shout, fail, info."
    assert outputs == ["3", "OK", "Error: fail failed: RuntimeError: boom", unknown]
    assert dialog[-1] == {"role": "assistant", "content": "Done."}
    assert tok.decode(generator.prompts[1]).count("<|start_header_id|>ipython<|end_header_id|>") == 4


def test_the_loop_stops_after_max_rounds(tok):
    again = '<|python_tag|>brave_search.call(query="more")<|eom_id|>'
    generator = StandInGenerator(tok, [again] * 3)
    dialog = chat_with_tools(generator, [{"role": "user", "content": "Search"}], TOOLS, max_rounds=2)
    assert [m["role"] for m in dialog] == ["user", "assistant", "ipython", "assistant"]
    assert dialog[2]["content"].startswith("Error: there is no tool named 'brave_search'")  # built-ins are not run
    assert calls_of(dialog[-1]) == [("brave_search", {"query": "more"})]  # the last call is returned, not run
    assert len(generator.answers) == 1
    with pytest.raises(ValueError, match="max_rounds"):
        chat_with_tools(generator, dialog, TOOLS, max_rounds=0)


# The example --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("example_tool_use", ROOT / "example_tool_use.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_calculator_reads_arithmetic_only(example):
    assert example.calculate("1234 * 5678") == "7006652"
    assert example.calculate(" (2 + 3) * -4 / 8 ") == "-2.5"
    assert example.calculate("2 ** 10 % 1000 // 3") == "8"
    for expression, error in [
        ("__import__('os').system('ls')", "only numbers"),
        ("x + 1", "only numbers"),
        ("(1).real", "only numbers"),
        ("9 ** 9 ** 9", "exponents above 100"),
        ("10.0 ** 99 * 1e10", "below 1e100"),
        ("(-8) ** 0.5", "real number"),
        ("1 +" * 100, "longer than 200"),
        ("1 +", "invalid syntax"),
    ]:
        with pytest.raises((ValueError, SyntaxError), match=error):
            example.calculate(expression)
    assert run_tool_call({"tool_name": "calculator", "arguments": {"expression": "1/0"}}, example.TOOLS) == (
        "Error: calculator failed: ZeroDivisionError: division by zero"
    )


def test_example_clock(example):
    assert example.clock(9).endswith("UTC+0900")
    assert run_tool_call({"tool_name": "clock", "arguments": {"utc_offset": 30}}, example.TOOLS) == (
        "Error: clock failed: ValueError: utc_offset must be between -14 and 14 hours"
    )


@pytest.mark.parametrize("tool_format", ["json", "python_list"])
def test_example_round_trip(example, tok, monkeypatch, capsys, tool_format):
    if tool_format == "json":
        first = '<|python_tag|>{"type": "function", "name": "calculator", "parameters": {"expression": "1234 * 5678"}}'
    else:
        first = "[calculator(expression='1234 * 5678'), clock(utc_offset=9)]<|eot_id|>"
    generator = StandInGenerator(tok, [first, "It is 7006652.<|eot_id|>"])
    monkeypatch.setattr(example.Llama, "build", staticmethod(lambda **kwargs: generator))
    example.main("unused", question="What is 1234 * 5678?", tool_format=tool_format)
    out = capsys.readouterr().out
    assert out.startswith(
        "Loaded in 0.01 seconds: a stand-in\nUser: What is 1234 * 5678?\n\n"
        "> Assistant calls calculator(expression='1234 * 5678')\n"
    )
    assert "  Tool result: 7006652\n" in out
    assert out.endswith("> Assistant: It is 7006652.\n")
    assert generator.formatter.tool_prompt_format == tool_format  # the calls went back in the form offered
    prompt = tok.decode(generator.prompts[0])
    assert ("Here is a list of functions in JSON format:\n{" if tool_format == "json" else "[func_name1(") in prompt


def test_example_checks_its_flags_before_loading(example, monkeypatch):
    monkeypatch.setattr(example.Llama, "build", staticmethod(lambda **kwargs: pytest.fail("loaded")))
    with pytest.raises(ValueError, match="tool_format"):
        example.main("unused", tool_format="xml")
    with pytest.raises(ValueError, match="temperature"):
        example.main("unused", temperature=-1)


@pytest.mark.slow
def test_example_runs_on_a_random_checkpoint(tiny_checkpoint, tokenizer_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "example_tool_use.py", "--ckpt_dir", str(tiny_checkpoint), "--tokenizer_path", tokenizer_path,
         "--max_gen_len", "4", "--device", "cpu", "--max_seq_len", "1024"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "User: What is 1234 * 5678" in result.stdout and "> Assistant" in result.stdout


def test_the_documented_loop_round_trip(tok, capsys):
    guide = (ROOT / "docs" / "tools.md").read_text()
    code = guide.split("## The loop, written out", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    answers = ['<|python_tag|>{"type": "function", "name": "add", "parameters": {"a": 2.5, "b": 40}}<|eom_id|>',
               "2.5 + 40 is 42.5.<|eot_id|>"]  # fmt: skip
    generator = StandInGenerator(tok, answers)
    exec(code, {"generator": generator})
    assert capsys.readouterr().out == "2.5 + 40 is 42.5.\n"
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n42.5<|eot_id|>" in tok.decode(generator.prompts[1])
