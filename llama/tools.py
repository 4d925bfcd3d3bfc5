"""Tool calling with Llama 3.1 and later: the prompts that offer tools to the model, and a loop that runs the
model's calls to Python functions you register and sends their results back.

The prompts are written as Meta's prompt-format documents for Llama 3.1, 3.2 and 3.3 show them, byte for byte:
`system_prompt` (built-in tools, "Environment: ipython", the dates), `json_tools_prompt` and
`function_tag_tools_prompt` (Llama 3.1's custom-tool definitions, sent as a user message) and
`python_list_tools_prompt` (Llama 3.2/3.3's, sent as the system message). `tool_messages` puts them together.

Reading calls out of the model's answers is `ChatFormat`'s work (`Llama.chat_completion` returns them);
`run_tool_call` runs one call of a registered `Tool`, after checking its arguments' names and types, and
`chat_with_tools` loops until the model answers. Nothing here, or anywhere in the library, runs code that the
model wrote: a `code_interpreter` call is returned like any other, and runs only if you register a tool by that
name yourself.
"""

import json
import math
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, TypedDict, Union

from llama.tokenizer import BUILTIN_TOOLS, TOOL_PROMPT_FORMATS, Dialog, Message, ToolCall, short_repr

__all__ = [
    "BUILTIN_TOOLS",
    "PARAM_TYPES",
    "TOOL_PROMPT_FORMATS",
    "Tool",
    "ToolDefinition",
    "ToolParameter",
    "chat_with_tools",
    "function_tag_tools_prompt",
    "json_tools_prompt",
    "python_list_tools_prompt",
    "run_tool_call",
    "system_prompt",
    "tool_messages",
]


class _ToolParameterFields(TypedDict):
    param_type: str  # e.g. "str", "int", "float", "bool" ("string", "integer", "number", "boolean" too)
    description: str


class ToolParameter(_ToolParameterFields, total=False):
    """One parameter of a custom tool, as the prompts describe it."""

    required: bool  # default True
    default: Any  # shown in the Llama 3.2/3.3 prompt when given


class ToolDefinition(TypedDict):
    """A custom tool (a function the model may call), as the prompts describe it."""

    name: str
    description: str
    parameters: Dict[str, ToolParameter]  # in the order the prompt lists them


# Parameter types that `run_tool_call` checks, by the names the prompts use for them.
PARAM_TYPES: Dict[str, type] = {
    "str": str, "string": str,
    "int": int, "integer": int,
    "float": float, "number": float,
    "bool": bool, "boolean": bool,
    "list": list, "array": list,
    "dict": dict, "object": dict,
}  # fmt: skip

_KNOWLEDGE_CUTOFF = "December 2023"
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")  # fmt: skip
_JSON_TOOLS_INTRO = (
    "Answer the user's question by making use of the following functions if needed.\n"
    "If none of the function can be used, please say so.\n"
    "Here is a list of functions in JSON format:\n"
)
_FUNCTION_TAG_RULES = (
    "Think very carefully before calling functions.\n"
    "If you choose to call a function ONLY reply in the following format with no prefix or suffix:\n\n"
    '<function=example_function_name>{"example_name": "example_value"}</function>\n\n'
    "Reminder:\n"
    "- If looking for real time information use relevant functions before falling back to brave_search\n"
    "- Function calls MUST follow the specified format, start with <function= and end with </function>\n"
    "- Required parameters MUST be specified\n"
    "- Only call one function at a time\n"
    "- Put the entire function call reply on one line"
)
_PYTHON_LIST_PREAMBLE = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the function can be used, point it out. If the given question lacks the parameters required by "
    "the function,\nalso point it out. You should only return the function call in tools call sections."
)
_PYTHON_LIST_RULES = (
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response.\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n\n"
)


# The prompts --------------------------------------------------------------------------------------------------


def system_prompt(
    builtin_tools: Sequence[str] = (),
    *,
    environment: Optional[bool] = None,
    instruction: Optional[str] = None,
    today: Union[date, str, None] = None,
) -> str:
    """The content of Llama 3.1's system message: tools environment, knowledge cutoff, today's date, instruction.

    As llama-models writes it: "Environment: ipython" (which turns on the code interpreter), "Tools: ..." naming
    the other built-in tools, "Cutting Knowledge Date: December 2023", "Today Date: 21 September 2024", then the
    instruction after a blank line, and a final newline.

    Args:
        builtin_tools: Built-in tools to offer, from `BUILTIN_TOOLS`, in the order to list them.
        environment: Write "Environment: ipython"; by default when any built-in tool is offered. Set it for custom
            tools (the Llama 3.1 JSON and function-tag formats), as `tool_messages` does.
        instruction: What the system message says besides, e.g. "You are a helpful assistant."
        today: The date to write: a `datetime.date`, or a str written as it is; by default today's.

    Returns:
        str: The system message's content.

    Raises:
        ValueError: For a tool that is not built in, built-in tools with `environment=False`, or an instruction
            that is not a str.
    """
    if isinstance(builtin_tools, str):
        raise ValueError(f"builtin_tools must be a list of names; wrap {builtin_tools!r} in a list")
    if instruction is not None and not isinstance(instruction, str):
        raise ValueError(f"instruction must be a str, got {type(instruction).__name__}")
    try:
        builtin_tools = list(builtin_tools)
    except TypeError:
        raise ValueError(f"builtin_tools must be a list of names, got {type(builtin_tools).__name__}") from None
    unknown = [name for name in builtin_tools if name not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"{short_repr(unknown)} are not built-in tools; the built-in tools are {list(BUILTIN_TOOLS)}")
    if environment is None:
        environment = bool(builtin_tools)
    if builtin_tools and not environment:
        raise ValueError("Built-in tools are offered in the 'Environment: ipython' section; leave environment set")
    text = ""
    if environment:
        named = [name for name in builtin_tools if name != "code_interpreter"]  # "Environment: ipython" is enough
        text = "Environment: ipython\n" + (f"Tools: {', '.join(named)}\n" if named else "\n")
    text += f"Cutting Knowledge Date: {_KNOWLEDGE_CUTOFF}\nToday Date: {_date_text(today)}"
    if instruction:
        text += "\n\n" + instruction
    return text + "\n"


def json_tools_prompt(tools: Sequence[Union["Tool", ToolDefinition]]) -> str:
    """Llama 3.1's custom tools in JSON, for a user message after the system message (the model answers with
    `{"type": "function", "name": ..., "parameters": {...}}`).

    Written as llama-models writes it: every parameter's "type" is "object" whatever its `param_type`, and the
    properties are a list of one-entry objects. Names and descriptions are escaped as JSON strings (llama-models
    writes them unescaped; the same text when they hold no quote, backslash or control character).

    Args:
        tools: The tools, as `Tool`s or `ToolDefinition`s.

    Returns:
        str: The message's content.

    Raises:
        ValueError: For a malformed definition.
    """
    blocks = []
    for tool in _definitions(tools):
        properties = ",".join(
            "\n                {\n"
            f'                    "{_json_text(name)}": {{\n'
            '                        "type": "object",\n'
            f'                        "description": "{_json_text(param["description"])}"\n'
            "                    }\n"
            "                }"
            for name, param in tool["parameters"].items()
        )
        required = [name for name, param in tool["parameters"].items() if param.get("required", True)]
        blocks.append(
            "{\n"
            '    "type": "function",\n'
            '    "function": {\n'
            f'        "name": "{_json_text(tool["name"])}",\n'
            f'        "description": "{_json_text(tool["description"])}",\n'
            '        "parameters": {\n'
            '            "type": "object",\n'
            f'            "properties": [{properties}\n'
            "            ],\n"
            f'            "required": {_jinja_json(required)}\n'
            "        }\n"
            "    }\n"
            "}\n"
        )
    return _JSON_TOOLS_INTRO + "".join(blocks) + "\nReturn function calls in JSON format."


def function_tag_tools_prompt(tools: Sequence[Union["Tool", ToolDefinition]]) -> str:
    """Llama 3.1's custom tools for calls written `<function=name>{"arg": value}</function>`, for a user message
    after the system message.

    Written as llama-models writes it: each parameter as {"description", "param_type", "required"} in one line of
    JSON with sorted keys and `<`, `>`, `&`, `'` escaped (jinja's `tojson`). Names and descriptions inside the
    JSON are escaped as JSON strings (see `json_tools_prompt`).

    Args:
        tools: The tools, as `Tool`s or `ToolDefinition`s.

    Returns:
        str: The message's content.

    Raises:
        ValueError: For a malformed definition.
    """
    text = "You have access to the following functions:\n\n"
    for tool in _definitions(tools):
        parameters = {
            name: {"description": p["description"], "param_type": p["param_type"], "required": p.get("required", True)}
            for name, p in tool["parameters"].items()
        }
        name, description = tool["name"], tool["description"]
        text += (
            f"Use the function '{name}' to '{description}':\n"
            f'{{"name": "{_json_text(name)}", "description": "{_json_text(description)}", '
            f'"parameters": {_jinja_json(parameters)}}}\n\n'
        )
    return text + _FUNCTION_TAG_RULES


def python_list_tools_prompt(tools: Sequence[Union["Tool", ToolDefinition]], preamble: Optional[str] = None) -> str:
    """Llama 3.2/3.3's custom tools, for the system message (the model answers with `[name(arg=value), ...]`).

    Written as the Llama 3.2 and 3.3 prompt-format documents show it: the instructions, then the tools as a JSON
    list indented by four spaces, each parameter with its "type" (its `param_type`), "description" and, when the
    definition gives one, "default".

    Args:
        tools: The tools, as `Tool`s or `ToolDefinition`s.
        preamble: Replaces the opening paragraph ("You are an expert in composing functions. ...").

    Returns:
        str: The message's content.

    Raises:
        ValueError: For a malformed definition, or a preamble that is not a str.
    """
    if preamble is not None and not isinstance(preamble, str):
        raise ValueError(f"preamble must be a str, got {type(preamble).__name__}")
    listed = []
    for tool in _definitions(tools):
        properties = {}
        for name, param in tool["parameters"].items():
            properties[name] = {"type": param["param_type"], "description": param["description"]}
            if "default" in param:
                properties[name]["default"] = param["default"]
        required = [name for name, param in tool["parameters"].items() if param.get("required", True)]
        parameters = {"type": "dict", "required": required, "properties": properties}
        listed.append({"name": tool["name"], "description": tool["description"], "parameters": parameters})
    intro = _PYTHON_LIST_PREAMBLE if preamble is None else preamble
    return f"{intro}\n\n{_PYTHON_LIST_RULES}{json.dumps(listed, indent=4, ensure_ascii=False)}"


def tool_messages(
    tools: Sequence[Union["Tool", ToolDefinition]] = (),
    builtin_tools: Sequence[str] = (),
    *,
    tool_format: str = "json",
    instruction: Optional[str] = None,
    today: Union[date, str, None] = None,
) -> List[Message]:
    """The messages that open a dialog with tools; append the user's question to them.

    "json" and "function_tag" (Llama 3.1): the system message of `system_prompt` ("Environment: ipython" when
    there are any tools), then, if there are custom tools, a user message defining them. "python_list" (Llama
    3.2 and 3.3): one system message, `python_list_tools_prompt`, with `instruction` as its opening paragraph if
    given; it has no built-in tools and no dates.

    Args:
        tools: Custom tools, as `Tool`s or `ToolDefinition`s.
        builtin_tools: Built-in tools, from `BUILTIN_TOOLS` ("json" and "function_tag" only).
        tool_format: "json", "function_tag" or "python_list". Give `Llama.formatter` (a `ChatFormat`) the same
            `tool_prompt_format`, so that the model's calls are written back into the dialog in the form it uses.
        instruction: The system message's own instruction, e.g. "You are a helpful assistant."
        today: The date for the system message (see `system_prompt`).

    Returns:
        list[Message]: One or two messages.

    Raises:
        ValueError: For an unknown format or tool, a malformed definition, or built-in tools with "python_list".
    """
    if tool_format not in TOOL_PROMPT_FORMATS:
        raise ValueError(f"Unknown tool_format {short_repr(tool_format)}; use one of {TOOL_PROMPT_FORMATS}")
    if tool_format == "python_list":
        if builtin_tools:
            raise ValueError('The "python_list" format (Llama 3.2/3.3) offers custom tools only; use "json" for '
                             "built-in tools")  # fmt: skip
        return [{"role": "system", "content": python_list_tools_prompt(tools, instruction)}]
    system = system_prompt(builtin_tools, environment=bool(tools) or bool(builtin_tools), instruction=instruction,
                           today=today)  # fmt: skip
    messages: List[Message] = [{"role": "system", "content": system}]
    if tools:
        describe = json_tools_prompt if tool_format == "json" else function_tag_tools_prompt
        messages.append({"role": "user", "content": describe(tools)})
    return messages


# Running the model's calls ------------------------------------------------------------------------------------


@dataclass
class Tool:
    """A Python function that the model may call, with the description the prompts give the model.

    Args:
        name: The name the model calls it by: a Python identifier.
        description: What it does, for the model.
        function: Called with the call's arguments as keyword arguments; what it returns (a str as it is, anything
            else as JSON) is sent back to the model.
        parameters: Each parameter's `ToolParameter`, in order: "param_type" (one of `PARAM_TYPES`, checked
            before the call), "description", and optionally "required" (default True) and "default".

    Raises:
        ValueError: For a name that is not an identifier, a function that is not callable, or a malformed
            parameter.
    """

    name: str
    description: str
    function: Callable[..., Any]
    parameters: Dict[str, ToolParameter] = field(default_factory=dict)

    def __post_init__(self):
        _check_definition(self.definition())
        if not self.name.isidentifier():
            raise ValueError(f"A tool name must be a Python identifier (the model calls it by name), got {self.name!r}")
        if not callable(self.function):
            raise ValueError(f"Tool {self.name!r}: function must be callable, got {short_repr(self.function)}")
        for name, param in self.parameters.items():
            if param["param_type"] not in PARAM_TYPES:
                raise ValueError(
                    f"Tool {self.name!r}, parameter {name!r}: param_type {param['param_type']!r} cannot be checked; "
                    f"use one of {sorted(PARAM_TYPES)}"
                )

    def definition(self) -> ToolDefinition:
        """The tool as the prompts describe it."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


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
        self, dialogs: List[Dialog], temperature: float = 0.6, top_p: float = 0.9, max_gen_len: Optional[int] = None
    ) -> List[Dict[str, Any]]: ...


def chat_with_tools(
    generator: ChatGenerator,
    dialog: Dialog,
    tools: Sequence[Tool],
    *,
    max_rounds: int = 4,
    temperature: float = 0.6,
    top_p: float = 0.9,
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


def _definitions(tools: Sequence[Union[Tool, ToolDefinition]]) -> List[ToolDefinition]:
    """Each tool's definition, checked; one without "parameters" gets an empty dict of them (the caller's dict is
    left as it is)."""
    definitions = [tool.definition() if isinstance(tool, Tool) else tool for tool in _tool_list(tools)]
    for definition in definitions:
        _check_definition(definition)
    return [{**definition, "parameters": definition.get("parameters", {})} for definition in definitions]


def _tool_list(tools: Any) -> list:
    """`tools` as a list; a ValueError for a single tool or something that is not a list."""
    if isinstance(tools, (Tool, Mapping, str, bytes)):
        raise ValueError(f"tools must be a list of tools; wrap a single tool in a list (got {type(tools).__name__})")
    try:
        return list(tools)
    except TypeError:
        raise ValueError(f"tools must be a list of tools, got {type(tools).__name__}") from None


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


def _check_definition(tool: ToolDefinition) -> None:
    """A ValueError that says what is wrong with a tool definition, if anything."""
    if not isinstance(tool, Mapping):
        raise ValueError(
            f"A tool must be a Tool or a dict with name, description and parameters; got {short_repr(tool)}"
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"A tool definition needs a 'name' that is a non-empty str; got {short_repr(tool)}")
    if not isinstance(tool.get("description"), str):
        raise ValueError(f"Tool {name!r} needs a 'description' that is a str")
    parameters = tool.get("parameters", {})
    if not isinstance(parameters, Mapping):
        raise ValueError(f"Tool {name!r}: 'parameters' must be a dict of parameter name to its definition")
    for pname, param in parameters.items():
        where = f"Tool {name!r}, parameter {short_repr(pname)}"
        if not isinstance(pname, str) or not pname:
            raise ValueError(f"Tool {name!r}: parameter names must be non-empty strs, got {short_repr(pname)}")
        if not isinstance(param, Mapping):
            raise ValueError(f"{where}: must be a dict with 'param_type' and 'description', got {short_repr(param)}")
        extra = set(param) - {"param_type", "description", "required", "default"}
        if extra:
            raise ValueError(f"{where}: unknown keys {sorted(extra)}; the keys are param_type, description, "
                             "required, default")  # fmt: skip
        if not isinstance(param.get("param_type"), str) or not isinstance(param.get("description"), str):
            raise ValueError(f"{where}: needs a 'param_type' and a 'description', both strs")
        if not isinstance(param.get("required", True), bool):
            raise ValueError(f"{where}: 'required' must be True or False")
        if "default" in param:
            try:
                json.dumps(param["default"], allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(f"{where}: the default, a {type(param['default']).__name__}, cannot be written as "
                                 f"JSON, as the prompt shows it ({e})") from None  # fmt: skip


def _date_text(today: Union[date, str, None]) -> str:
    """A date as the system prompt writes it, "21 September 2024" (in English, whatever the locale)."""
    if isinstance(today, str):
        return today
    if today is None:
        today = date.today()
    if not isinstance(today, date):
        raise ValueError(f"today must be a datetime.date or a str, got {type(today).__name__}")
    return f"{today.day:02d} {_MONTHS[today.month - 1]} {today.year}"


def _json_text(text: str) -> str:
    """`text` escaped to sit between double quotes in JSON (non-ASCII characters kept as they are)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _jinja_json(value: Any) -> str:
    """`value` as jinja's `tojson` writes it, which llama-models' templates use: sorted keys, ASCII only, and
    `<`, `>`, `&`, `'` escaped."""
    text = json.dumps(value, sort_keys=True)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        text = text.replace(char, escaped)
    return text
