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

The package has one module for each part: `definitions` (what a tool is), `prompts` and `run`.
"""

from llama.tokenizer import BUILTIN_TOOLS, TOOL_PROMPT_FORMATS
from llama.tools.definitions import PARAM_TYPES, Tool, ToolDefinition, ToolParameter
from llama.tools.prompts import (
    function_tag_tools_prompt,
    json_tools_prompt,
    python_list_tools_prompt,
    system_prompt,
    tool_messages,
)
from llama.tools.run import chat_with_tools, run_tool_call

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
