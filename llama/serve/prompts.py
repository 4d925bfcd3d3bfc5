"""Requests turned into engine work: a completion's prompts as token IDs, a chat's messages as a llama dialog (with
the tools it offers and the images it shows), vLLM's /tokenize bodies, and the grammar an answer must follow. Errors
are `APIError`s (400) that name the field."""

import json
from typing import List, Optional, Union

from llama.serve.data_urls import image_bytes
from llama.serve.protocol import (
    APIError,
    ChatMessage,
    ChatRequest,
    ImagePart,
    NamedToolChoice,
    Sampling,
    TokenizeChat,
    TokenizePrompt,
    ToolCallSpec,
    ToolSpec,
)
from llama.tokenizer import ChatFormat, Message, Tokenizer
from llama.tools import tool_messages
from llama.vision.batch import MAX_IMAGES
from llama.vision.images import open_image


def completion_prompts(prompt, tokenizer: Tokenizer, vocab_size: int) -> List[List[int]]:
    """A completion request's `prompt` as token-ID lists, texts encoded as `Llama.text_completion` encodes them
    (<|begin_of_text|> first). Raises APIError (400) for no prompt, an empty one, or a token ID outside the
    vocabulary, naming which."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: send a text, texts, token IDs or lists of token IDs", "prompt")
    prompts = []
    for i, one in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if not one:
            raise APIError(400, f"{where} is empty: give every prompt at least one token", where)
        if isinstance(one, str):
            prompts.append(tokenizer.encode(one, bos=True, eos=False))
            continue
        check_in_vocabulary(one, vocab_size, where)
        prompts.append(list(one))
    return prompts


def check_in_vocabulary(tokens: List[int], vocab_size: int, where: str) -> None:
    """Raises APIError (400, param `where`) naming the first of `tokens` (ints: pydantic checked the type) outside
    the vocabulary, as `where[k]`."""
    bad = next((k for k, token in enumerate(tokens) if not 0 <= token < vocab_size), None)
    if bad is not None:
        message = f"{where}[{bad}] is token ID {tokens[bad]}, outside the vocabulary (0 to {vocab_size - 1})"
        raise APIError(400, message, where)


def tokenize(
    request: Union[TokenizePrompt, TokenizeChat], formatter: ChatFormat, takes_images: bool = False
) -> List[int]:
    """The token IDs of a /tokenize request, each image one `<|image|>` (`dialog_of`: images only where
    `takes_images`). Raises APIError (400) for messages that cannot be written."""
    if isinstance(request, TokenizePrompt):
        return formatter.tokenizer.encode(request.prompt, bos=request.add_special_tokens, eos=False)
    chat = ChatRequest(model=request.model or "", messages=request.messages, tools=request.tools)
    dialog = dialog_of(chat, formatter, takes_images)
    if request.add_generation_prompt and not request.continue_final_message:
        return formatter.encode_dialog_prompt(dialog)
    tokens = [formatter.tokenizer.special_tokens["<|begin_of_text|>"]]
    for message in dialog:
        tokens += formatter.encode_message(message)
    return tokens[:-1] if request.continue_final_message else tokens  # open: without its end-of-turn token


def answer_format(request: Sampling) -> Optional[dict]:
    """The `response_format` (as `llama.decoding.grammar.Grammar.from_response_format` takes it) that a request's answer
    must follow: its own, or, where a chat request's `tool_choice` names a function, a call of that function as
    Llama 3.1 writes one, its arguments following the function's parameters. None: free text."""
    choice = getattr(request, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        functions = {tool.function.name: tool.function for tool in request.tools or []}
        if choice.function.name not in functions:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        call = {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "name": {"const": choice.function.name},
                "parameters": functions[choice.function.name].parameters or {"type": "object"},
            },
            "required": ["type", "name", "parameters"],
            "additionalProperties": False,
        }
        return {"type": "json_schema", "json_schema": {"name": choice.function.name, "schema": call}}
    return None if request.response_format is None else request.response_format.as_dict()


def dialog_of(request: ChatRequest, formatter: ChatFormat, takes_images: bool = False) -> List[Message]:
    """The request's messages as a llama dialog, after the messages that offer its tools, if any.

    A "developer" message is a system message; a leading system message becomes the tools' system prompt's
    instruction. Text parts are joined into one string, unless the message has an image: then its content is llama's
    text and image parts, in order, each image decoded (`message_content`). Raises APIError (400) naming the message
    or part that cannot be written, images included where the model takes none (`check_image_parts`).
    """
    check_image_parts(request.messages, takes_images)
    dialog: List[Message] = []
    for i, message in enumerate(request.messages):
        content = message_content(message, i)
        if content is None and not message.tool_calls:
            raise APIError(400, f"Message {i} has no content", f"messages[{i}].content")
        converted: Message = {
            "role": "system" if message.role == "developer" else message.role,
            "content": content or "",
        }
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(400, "Only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            converted["tool_calls"] = [tool_call_in(call, i) for call in message.tool_calls]
        dialog.append(converted)
    offered = request.tools if request.tool_choice != "none" else None
    if offered or any(m["role"] == "tool" or m.get("tool_calls") for m in dialog):
        if formatter.tokenizer.version == "3":
            raise APIError(400, "Tools need a Llama 3.1 or later checkpoint; this model has Llama 3 tokens", "tools")
    if offered:
        instruction = dialog.pop(0)["content"] if dialog and dialog[0]["role"] == "system" else None
        try:
            dialog = tool_messages([tool_definition(tool) for tool in offered], instruction=instruction) + dialog
        except ValueError as e:
            raise APIError(400, str(e), "tools") from None
    return dialog


def check_image_parts(messages: List[ChatMessage], takes_images: bool) -> None:
    """Raises APIError (400) before any image is decoded: for an image part where the model takes no images, or in
    a message other than a user's (as OpenAI's API takes them; the model only reads images, it never writes one),
    naming the first such part; or for more than `MAX_IMAGES` images in the request."""
    found = 0
    for i, message in enumerate(messages):
        parts = message.content if isinstance(message.content, list) else []
        for k, part in enumerate(parts):
            if not isinstance(part, ImagePart):
                continue
            param = f"messages[{i}].content[{k}]"
            if not takes_images:
                raise APIError(
                    400, f"{param} is an image, and this model takes no images (Llama 3.2 Vision models do)", param
                )
            if message.role != "user":
                problem = f"{param} is an image in a message of role {message.role!r}: send images in user messages"
                raise APIError(400, problem, param)
            found += 1
    if found > MAX_IMAGES:
        problem = f"The messages hold {found} images; Llama 3.2 Vision takes at most {MAX_IMAGES} a request here"
        raise APIError(400, problem, "messages")


# The most pixels of an image the server decodes, from its header: 64 Mi, a 48-megapixel photo with room to spare (its
# RGB pixels take up to 192 MiB). Pillow's own limit is near 179 million, whose pixel data a small file can claim.
MAX_IMAGE_PIXELS = 64 * 2**20


def message_content(message: ChatMessage, i: int) -> Union[str, List[dict], None]:
    """Message `i`'s content as llama's: a string as given, text parts joined into one string (written as a string
    is: stripped), or, where an image is among them, llama's parts in order, text as given (as llama-models writes
    parts) and each image decoded from its data URL (`open_image`: a 400 naming the part that is not an image)."""
    content = message.content
    if not isinstance(content, list):
        return content
    if not any(isinstance(part, ImagePart) for part in content):
        return "".join(part.text for part in content)
    parts = []
    for k, part in enumerate(content):
        if not isinstance(part, ImagePart):
            parts.append({"type": "text", "text": part.text})
            continue
        param = f"messages[{i}].content[{k}].image_url.url"
        try:
            image = open_image(image_bytes(part.image_url.url, param), MAX_IMAGE_PIXELS)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param) from None
        parts.append({"type": "image", "image": image})
    return parts


def tool_call_in(call: ToolCallSpec, i: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, "tool_calls arguments must be a JSON object", f"messages[{i}].tool_calls")
    return {"tool_name": call.function.name, "arguments": arguments, "call_id": call.id or ""}


def tool_definition(tool: ToolSpec) -> dict:
    """An OpenAI function (its parameters a JSON schema) as llama's ToolDefinition."""
    schema = tool.function.parameters
    required = set(schema.get("required", []))
    parameters = {
        name: {
            "param_type": str(spec.get("type", "string")),
            "description": str(spec.get("description", "")),
            "required": name in required,
        }
        for name, spec in schema.get("properties", {}).items()
    }
    return {"name": tool.function.name, "description": tool.function.description, "parameters": parameters}
