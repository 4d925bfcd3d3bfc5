"""Running the model's calls: `run_tool_call` runs one call of a registered `Tool` after checking its arguments'
names and types, and `chat_with_tools` loops until the model answers."""

import json
import math
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence

from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, short_repr
from llama.tokenizer import Dialog, Message, ToolCall
from llama.tools.definitions import PARAM_TYPES, Tool, _tool_list


def run_tool_call(call: ToolCall, tools: Sequence[Tool]) -> str:
    """Runs one call of the model, if it names one of `tools` with arguments that fit; never raises for a bad call.

    The arguments must be the tool's parameter names, with every required one, of the declared types. A str that
    spells a number or a boolean is read as one for an "int", "float" or "bool" parameter (models often quote
    them), an int passes for a "float" and a whole float for an "int"; a bool is never a number, and a float must
    be finite. Anything else that does not fit, an unknown tool (built-in ones included), and an exception
    raised by the function come back as a message that starts with "Error:", for the model to read.

    Args:
        call: A call from `Llama.chat_completion`'s "tool_calls".
        tools: The registered tools, as `Tool`s (a definition dict has no function to run).

    Returns:
        str: The tool's result (a str as returned, anything else as JSON), or the error message; also a result
            that cannot be written as JSON comes back as an "Error:" message.

    Raises:
        ValueError: If `tools` is not a list of `Tool`s with distinct names: a mistake in the program, not in the
            model's call.
    """
    by_name = _tools_by_name(tools)
    name = call.get("tool_name") if isinstance(call, Mapping) else None
    if not isinstance(name, str) or name not in by_name:
        offered = ", ".join(by_name) or "none"
        return f"Error: there is no tool named {short_repr(name)}. The tools are: {offered}."
    tool = by_name[name]
    arguments = call.get("arguments")
    if not isinstance(arguments, Mapping):
        return f"Error: the arguments of {name} must be an object of named values, got {short_repr(arguments)}."
    unknown = [key for key in arguments if key not in tool.parameters]
    if unknown:
        known = ", ".join(tool.parameters) or "none"
        return f"Error: {name} has no parameter {', '.join(map(repr, unknown))}. Its parameters are: {known}."
    missing = [key for key, p in tool.parameters.items() if p.get("required", True) and key not in arguments]
    if missing:
        return f"Error: {name} needs the argument{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}."
    checked = {}
    for key, value in arguments.items():
        param_type = tool.parameters[key]["param_type"]
        checked[key] = _as_type(value, PARAM_TYPES[param_type])
        if checked[key] is _WRONG:
            return f"Error: the argument {key!r} of {name} must be of type {param_type}, got {short_repr(value)}."
    try:
        result = tool.function(**checked)
    except Exception as e:  # the model sees what went wrong, and may try again
        return f"Error: {name} failed: {type(e).__name__}: {e}"
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except Exception as e:  # e.g. a circular list, or an object whose str() raises
        return f"Error: the result of {name} cannot be written as JSON: {type(e).__name__}: {e}"


class ChatGenerator(Protocol):
    """What `chat_with_tools` needs of a generator: `Llama.chat_completion`."""

    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
    ) -> List[Dict[str, Any]]: ...


def chat_with_tools(
    generator: ChatGenerator,
    dialog: Dialog,
    tools: Sequence[Tool],
    *,
    max_rounds: int = 4,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_gen_len: Optional[int] = None,
) -> List[Message]:
    """Asks the model to answer `dialog`, running the tools it calls, until it answers without calling any.

    Each answer is appended to the dialog as the model's message (with its "tool_calls" and "stop_reason" when
    it calls tools); each call is run by `run_tool_call` and its result appended as an "ipython" message, in the
    order of the calls; then the model is asked again.

    Args:
        generator: A `Llama` (or anything with its `chat_completion`).
        dialog: The dialog so far, e.g. `tool_messages(...)` plus the user's question. It is not modified.
        tools: The tools the model may call.
        max_rounds: The most answers to ask for. If the last one still calls tools, they are not run, and the
            returned dialog ends with that call.
        temperature: As for `Llama.chat_completion`.
        top_p: As for `Llama.chat_completion`.
        max_gen_len: As for `Llama.chat_completion`.

    Returns:
        list[Message]: The dialog with the answers and the tools' results appended.

    Raises:
        ValueError: For `max_rounds` below 1, `tools` that are not `Tool`s (see `run_tool_call`), or what
            `chat_completion` raises (e.g. a dialog grown longer than max_seq_len).
    """
    if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
        raise ValueError(f"max_rounds must be an integer of at least 1, got {short_repr(max_rounds)}")
    _tools_by_name(tools)
    dialog = list(dialog)
    for round_number in range(1, max_rounds + 1):
        result = generator.chat_completion([dialog], temperature=temperature, top_p=top_p, max_gen_len=max_gen_len)
        message = result[0]["generation"]
        dialog.append(message)
        if not message.get("tool_calls") or round_number == max_rounds:
            break
        for call in message["tool_calls"]:
            dialog.append({"role": "ipython", "content": run_tool_call(call, tools)})
    return dialog


# Helpers ------------------------------------------------------------------------------------------------------

_WRONG = object()  # `_as_type`'s answer for a value that does not fit


def _as_type(value: Any, expected: type) -> Any:
    """`value` as `expected` (with the conversions `run_tool_call` allows), or `_WRONG`."""
    if isinstance(value, str) and expected in (int, float, bool):
        text = value.strip().lower()
        if expected is bool:
            return {"true": True, "false": False}.get(text, _WRONG)
        try:
            value = int(text) if expected is int else float(text)
        except ValueError:
            return _WRONG
    if expected is bool:
        return value if isinstance(value, bool) else _WRONG
    if isinstance(value, bool):  # True is an int to Python, not to a tool
        return _WRONG
    if expected is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if expected is float and isinstance(value, (int, float)):
        return value if math.isfinite(value) else _WRONG
    return value if isinstance(value, expected) else _WRONG


def _tools_by_name(tools: Sequence[Tool]) -> Dict[str, Tool]:
    """The `Tool`s by name, for running them; a ValueError for a definition dict or two tools of one name."""
    by_name: Dict[str, Tool] = {}
    for tool in _tool_list(tools):
        if not isinstance(tool, Tool):
            raise ValueError(
                f"Only Tool objects can be run, got a {type(tool).__name__}: a definition has no function to run; "
                "make it Tool(name, description, function, parameters)"
            )
        if tool.name in by_name:
            raise ValueError(f"Two tools are named {tool.name!r}; the model could not tell them apart")
        by_name[tool.name] = tool
    return by_name
