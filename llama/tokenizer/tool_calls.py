"""Tool calls as text: how a call is written into a prompt (llama-models' formats) and how the calls in a model's
answer are found. The answer is hostile text: every parser here runs in time linear in its length."""

import ast
import json
import re
import uuid
import warnings
from typing import Any, Optional

from llama.arguments import short_repr
from llama.tokenizer.messages import ToolCall

# The tools Llama 3.1+ was trained to call by name. The first three are called as `name.call(query="...")`, the
# code interpreter by writing Python code after <|python_tag|>.
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "photogen", "code_interpreter")
_QUERY_TOOLS = ("brave_search", "wolfram_alpha", "photogen")
# How calls to custom tools (functions) are written back into a prompt; llama-models' default is "json".
TOOL_PROMPT_FORMATS = ("json", "function_tag", "python_list")


def check_tool_call(call: ToolCall) -> None:
    """Raises a ValueError that says what is wrong with a tool call given in a message, if anything.

    A call is a dict with "tool_name" (a non-empty str) and "arguments" (a dict), and optionally "call_id". The
    built-in search tools need a "query" argument, the code interpreter a "code" argument that is a str.
    """
    if not isinstance(call, dict):
        raise ValueError(f"A tool call must be a dict with 'tool_name' and 'arguments', got {short_repr(call)}")
    name = call.get("tool_name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"A tool call needs a 'tool_name' that is a non-empty str; got {short_repr(call)}")
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        raise ValueError(f"The call to {name!r} needs 'arguments' that is a dict, got {short_repr(arguments)}")
    if name in _QUERY_TOOLS and "query" not in arguments:
        raise ValueError(
            f"The call to the built-in tool {name!r} needs a 'query' argument, got {short_repr(arguments)}"
        )
    if name == "code_interpreter" and not isinstance(arguments.get("code"), str):
        raise ValueError(f"The call to 'code_interpreter' needs a 'code' argument (a str), got {short_repr(arguments)}")


def encode_tool_call(call: ToolCall, tool_prompt_format: str = "json") -> str:
    """The text of a tool call as an assistant message holds it (llama-models' forms).

    `brave_search`, `wolfram_alpha` and `photogen`: `name.call(query="...")`. `code_interpreter`: the code itself
    (the message puts `<|python_tag|>` before its content). Any other tool, by `tool_prompt_format`:
    "json": `{"type": "function", "name": ..., "parameters": ...}` as `json.dumps` writes it with its defaults;
    "function_tag": `<function=name>{json arguments}</function>`; "python_list": `[name(a="x", b=2)]`.

    Args:
        call (ToolCall): The call.
        tool_prompt_format (str): One of `TOOL_PROMPT_FORMATS`.

    Returns:
        str: The call's text, to be tokenized on its own.

    Raises:
        ValueError: If the call is malformed (see `check_tool_call`), its arguments cannot be written in the
            format, or the format is unknown.
    """
    check_tool_call(call)
    name, arguments = call["tool_name"], call["arguments"]
    if name in _QUERY_TOOLS:
        return f'{name}.call(query="{arguments["query"]}")'
    if name == "code_interpreter":
        return arguments["code"]
    try:
        if tool_prompt_format == "json":
            return json.dumps({"type": "function", "name": name, "parameters": arguments})
        if tool_prompt_format == "function_tag":
            return f"<function={name}>{json.dumps(arguments)}</function>"
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"The arguments of the call to {name!r} cannot be written as JSON: {e}") from None
    if tool_prompt_format == "python_list":
        try:
            return f"[{name}({', '.join(f'{key}={_python_value(value)}' for key, value in arguments.items())})]"
        except RecursionError:
            raise ValueError(
                f"The arguments of the call to {name!r} are nested too deeply, or hold themselves"
            ) from None
    raise ValueError(f"Unknown tool_prompt_format {short_repr(tool_prompt_format)}; use one of {TOOL_PROMPT_FORMATS}")


def parse_tool_calls(text: str, python_tag: bool = False) -> list[ToolCall]:
    """The tool calls in an answer's text, by the rules of `ChatFormat.decode_assistant_message_from_content`.

    Args:
        text (str): The answer, without its leading `<|python_tag|>` and final stop token.
        python_tag (bool): Whether the answer began with `<|python_tag|>`: then text that is no other call is
            code for the code interpreter.

    Returns:
        list[ToolCall]: The calls found, each with a fresh "call_id"; empty if there are none.
    """
    found = _custom_tool_calls(text)
    if found is None:
        match = _BUILTIN_CALL.search(text)
        if match:
            found = [(match["tool_name"], {"query": match["query"]})]
        elif python_tag:
            found = [("code_interpreter", {"code": text})]
        else:
            found = []
    return [{"call_id": str(uuid.uuid4()), "tool_name": name, "arguments": arguments} for name, arguments in found]


# A built-in search tool's call; any word before ".call" is taken as the tool's name. Linear in the text: `\b\w+`
# starts only at a word's first character, and `[^"]*` gives up at the first quote.
_BUILTIN_CALL = re.compile(r'\b(?P<tool_name>\w+)\.call\(query="(?P<query>[^"]*)"\)')
_Calls = Optional[list[tuple[str, dict]]]


def _python_value(value: Any) -> str:
    """A call argument as the "python_list" format writes it (llama-models' rules: strings in double quotes as they
    are, dicts as {key=value})."""
    if isinstance(value, str):
        return f'"{value}"'
    if value is None or isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_python_value(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_python_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"A tool call argument of type {type(value).__name__} cannot be written as a Python value")


def _custom_tool_calls(text: str) -> _Calls:
    """Calls in one of the custom-tool forms (function tag, JSON object, Python list), or None."""
    tag = _function_tag(text)
    if tag:
        name, args_start, args_end = tag
        arguments = _tag_arguments(text, args_start, args_end)
        calls = None if arguments is None else [(name, arguments)]
    elif (obj := _json_object(text)) is not None:
        calls = None
        if obj.get("type") == "function" or "name" in obj:
            name, parameters = obj.get("name"), obj.get("parameters")
            if isinstance(name, str) and name and isinstance(parameters, dict):
                calls = [(name, parameters)]
    else:
        calls = _python_list_calls(text)
    if calls is None:
        return None
    calls = [_builtin_as_called(name, arguments) for name, arguments in calls]
    return None if None in calls else calls


def _builtin_as_called(name: str, arguments: dict) -> Optional[tuple[str, dict]]:
    """A built-in tool called in a custom-tool form takes its first argument as the query (None: it has none)."""
    if name not in BUILTIN_TOOLS:
        return name, arguments
    return (name, {"query": next(iter(arguments.values()))}) if arguments else None


def _function_tag(text: str) -> Optional[tuple[str, int, int]]:
    """The first `<function=name>{...}` in `text`: the name, and where its arguments start ("{") and end (after the
    first "}"); None if there is none.

    What llama-models' pattern `<function=([^}]+)>({.*?})` finds, read in one pass instead of by a backtracking
    regex (which takes minutes on a few kB of repeated `<function=x>{`). For a `<function=` the name runs to the
    first "}" after it at most, so the arguments end at that "}"; the greedy name makes them start at the last ">{"
    before it, and they may not hold a line break (`.` does not match one). When that fails, every later
    `<function=` before the same "}" fails too, so the search goes on after it.
    """
    prefix = "<function="
    start = text.find(prefix)
    while start >= 0:
        name_start = start + len(prefix)
        close = text.find("}", name_start)
        if close < 0:
            return None
        opening = text.rfind(">{", name_start + 1, close)  # the name has at least one character
        if opening >= 0 and text.find("\n", opening + 2, close) < 0:
            return text[name_start:opening], opening + 1, close + 1
        start = text.find(prefix, close + 1)
    return None


def _tag_arguments(text: str, args_start: int, args_end: int) -> Optional[dict]:
    """The JSON object at `text[args_start:args_end]`, after `<function=name>`: as it is, else read in full from its
    "{" (it ends at the first "}", inside any nested object), else with single quotes read as double ones."""
    args = text[args_start:args_end]
    attempts = (
        lambda: json.loads(args),
        lambda: json.JSONDecoder().raw_decode(text, args_start)[0],
        lambda: json.loads(args.replace("'", '"')),
    )
    for attempt in attempts:
        try:
            value = attempt()
        except (ValueError, RecursionError):
            continue
        return value if isinstance(value, dict) else None
    return None


def _json_object(text: str) -> Optional[dict]:
    """`text` read as one JSON object, or None."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _python_list_calls(text: str) -> _Calls:
    """The calls of `text` read as a Python list of calls with keyword arguments of literal values, or None.

    Nothing is evaluated: the text is parsed, and only literals (strings, numbers, booleans, None, and lists and
    dicts of them) are read.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for an invalid escape in a string
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    expr = tree.body[0].value
    if not isinstance(expr, ast.List) or not expr.elts:
        return None
    calls = []
    for call in expr.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        arguments = {}
        for keyword in call.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _plain(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append((call.func.id, arguments))
    return calls


def _plain(value: Any) -> Any:
    """`value` as JSON data (tuples become lists); a ValueError for anything else (sets, bytes, complex numbers)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    raise ValueError(f"not JSON data: {type(value).__name__}")
