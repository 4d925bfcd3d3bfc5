"""The prompts that offer tools to the model, written as Meta's prompt-format documents for Llama 3.1, 3.2 and 3.3
show them, byte for byte, and `tool_messages`, which puts them together."""

import json
from datetime import date
from typing import Any, List, Optional, Sequence, Union

from llama.arguments import short_repr
from llama.tokenizer import BUILTIN_TOOLS, TOOL_PROMPT_FORMATS, Message
from llama.tools.definitions import Tool, ToolDefinition, _definitions

_KNOWLEDGE_CUTOFF = "December 2023"
_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
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
            raise ValueError(
                'The "python_list" format (Llama 3.2/3.3) offers custom tools only; use "json" for built-in tools'
            )
        return [{"role": "system", "content": python_list_tools_prompt(tools, instruction)}]
    system = system_prompt(
        builtin_tools, environment=bool(tools) or bool(builtin_tools), instruction=instruction, today=today
    )
    messages: List[Message] = [{"role": "system", "content": system}]
    if tools:
        describe = json_tools_prompt if tool_format == "json" else function_tag_tools_prompt
        messages.append({"role": "user", "content": describe(tools)})
    return messages


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
