"""What a custom tool is: its definition as the prompts describe it (`ToolDefinition`, checked), and a `Tool`,
that definition with the Python function that runs it."""

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Sequence, TypedDict, Union

from llama.arguments import short_repr


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
    "str": str,
    "string": str,
    "int": int,
    "integer": int,
    "float": float,
    "number": float,
    "bool": bool,
    "boolean": bool,
    "list": list,
    "array": list,
    "dict": dict,
    "object": dict,
}


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
            raise ValueError(
                f"{where}: unknown keys {sorted(extra)}; the keys are param_type, description, required, default"
            )
        if not isinstance(param.get("param_type"), str) or not isinstance(param.get("description"), str):
            raise ValueError(f"{where}: needs a 'param_type' and a 'description', both strs")
        if not isinstance(param.get("required", True), bool):
            raise ValueError(f"{where}: 'required' must be True or False")
        if "default" in param:
            try:
                json.dumps(param["default"], allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(
                    f"{where}: the default, a {type(param['default']).__name__}, cannot be written as "
                    f"JSON, as the prompt shows it ({e})"
                ) from None
