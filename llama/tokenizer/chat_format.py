"""The Llama 3 chat format: messages and dialogs written as tokens, tool calls included (Llama 3.1 and later), and
an assistant's answer read back into a message."""

from collections.abc import Iterable, Sequence
from typing import Optional

from llama.arguments import short_repr
from llama.tokenizer.bpe import Tokenizer
from llama.tokenizer.content import content_parts, encode_parts
from llama.tokenizer.messages import ROLES, STOP_REASONS, STOP_TOKEN_REASONS, Dialog, Message, StopReason, ToolCall
from llama.tokenizer.tool_calls import TOOL_PROMPT_FORMATS, check_tool_call, encode_tool_call, parse_tool_calls


def stop_reason(tokenizer: Tokenizer, token: int) -> Optional[StopReason]:
    """Why an answer that stops at `token` ended: the reason `STOP_TOKEN_REASONS` gives <|eot_id|> and <|eom_id|>,
    "end_of_turn" for the tokenizer's other stop token (<|end_of_text|>, how a base model ends a text), and None
    for a token that is not one of `tokenizer.stop_tokens`."""
    if token not in tokenizer.stop_tokens:
        return None
    for name, reason in STOP_TOKEN_REASONS.items():
        if tokenizer.special_tokens.get(name) == token:
            return reason
    return "end_of_turn"


class ChatFormat:
    """Writes messages and dialogs in the Llama 3 chat format, tool calls included (Llama 3.1 and later), and reads
    an assistant's answer back into a message with its tool calls."""

    def __init__(self, tokenizer: Tokenizer, *, tool_prompt_format: str = "json", strip_content: bool = True):
        """Sets up the format for `tokenizer`'s special tokens and chat roles.

        Args:
            tokenizer (Tokenizer): The tokenizer; its version decides the roles and tokens available.
            tool_prompt_format (str): How calls to custom tools in assistant messages are written: "json" (the
                default, as llama-models writes them), "function_tag" or "python_list". Built-in tools are
                always written in their own format.
            strip_content (bool): Strip whitespace around each message's content, as Meta's Llama 3 reference
                does (the default, and what `Llama` uses). False keeps content as given, as llama-models does;
                the two agree on content with no whitespace at either end.

        Raises:
            ValueError: If `tool_prompt_format` is not one of `TOOL_PROMPT_FORMATS`.
        """
        if tool_prompt_format not in TOOL_PROMPT_FORMATS:
            raise ValueError(
                f"Unknown tool_prompt_format {short_repr(tool_prompt_format)}; use one of {TOOL_PROMPT_FORMATS}"
            )
        self.tokenizer = tokenizer
        self.tool_prompt_format = tool_prompt_format
        self.strip_content = strip_content

    def encode_header(self, message: Message) -> list[int]:
        """Encodes `<|start_header_id|>` role `<|end_header_id|>` and the blank line after it.

        The "tool" role is written as "ipython", the role Llama 3.1 was trained with.

        Args:
            message (Message): The message whose role to encode; its content is ignored.

        Returns:
            list[int]: The header's token IDs.

        Raises:
            ValueError: If the role is not allowed for this tokenizer's version.
        """
        role = message["role"]
        allowed = ROLES[self.tokenizer.version]
        if role not in allowed:
            needs_31 = role in ROLES["3.1"]
            hint = f' (the "{role}" role needs a Tokenizer with version="3.1")' if needs_31 else ""
            raise ValueError(f"Unknown message role {short_repr(role)}; allowed roles are {list(allowed)}{hint}")
        tokens = [self.tokenizer.special_tokens["<|start_header_id|>"]]
        tokens.extend(self.tokenizer.encode("ipython" if role == "tool" else role, bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|end_header_id|>"])
        tokens.extend(self.tokenizer.encode("\n\n", bos=False, eos=False))
        return tokens

    def encode_message(self, message: Message) -> list[int]:
        """Encodes a message: its header, its content stripped of surrounding whitespace (unless `strip_content` is
        False), then `<|eot_id|>`. Content given as a list of parts is written as llama-models writes it: each text
        part as given, each image part as `<|image|>` (Llama 3.2 Vision).

        An assistant message may carry `tool_calls` (Llama 3.1+). Each call is written after the content and
        tokenized on its own, as llama-models does: built-in search tools as `name.call(query="...")`, the code
        interpreter as its code after a leading `<|python_tag|>`, custom tools in `tool_prompt_format`. With
        `"stop_reason": "end_of_message"` the message ends with `<|eom_id|>` instead of `<|eot_id|>`.

        Args:
            message (Message): The message to encode.

        Returns:
            list[int]: The message's token IDs.

        Raises:
            ValueError: If the message has no role or content, the role is not allowed, the content is neither a
                str nor a list of text and image parts (`llama.tokenizer.content`), or its tool calls or stop
                reason are malformed or need Llama 3.1 tokens.
        """
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"A message must be a dict with a 'role' and a 'content'; got {short_repr(message)}")
        tokens = self.encode_header(message)
        content = message["content"]
        parts = content_parts(content)
        tool_calls, end_of_message = _check_assistant_fields(message, self.tokenizer.version)
        if tool_calls and tool_calls[0]["tool_name"] == "code_interpreter":
            tokens.append(self.tokenizer.special_tokens["<|python_tag|>"])
        if isinstance(content, str):
            tokens.extend(
                self.tokenizer.encode(content.strip() if self.strip_content else content, bos=False, eos=False)
            )
        else:  # a list of parts, as llama-models writes them: each text as given, each image as <|image|>
            tokens.extend(encode_parts(self.tokenizer, parts, bos=False))
        for call in tool_calls:
            tokens.extend(self.tokenizer.encode(encode_tool_call(call, self.tool_prompt_format), bos=False, eos=False))
        tokens.append(self.tokenizer.special_tokens["<|eom_id|>" if end_of_message else "<|eot_id|>"])
        return tokens

    def encode_dialog_prompt(self, dialog: Dialog) -> list[int]:
        """Encodes a dialog as a prompt: `<|begin_of_text|>`, every message, then an assistant header with
        no content after it, so that what the model generates next is the assistant's reply.

        Args:
            dialog (Dialog): The messages, in order.

        Returns:
            list[int]: The prompt's token IDs.

        Raises:
            ValueError: If `dialog` is not a list of messages, or a message cannot be encoded (see
                `encode_message`).
        """
        if isinstance(dialog, dict):
            raise ValueError("A dialog is a list of messages; wrap a single message in a list")
        if isinstance(dialog, (str, bytes)) or not isinstance(dialog, Iterable):
            raise ValueError(f"A dialog must be a list of messages, got {type(dialog).__name__}")
        tokens = [self.tokenizer.special_tokens["<|begin_of_text|>"]]
        for message in dialog:
            tokens.extend(self.encode_message(message))
        tokens.extend(self.encode_header({"role": "assistant", "content": ""}))
        return tokens

    def decode_assistant_message(self, tokens: Sequence[int], stop_reason: StopReason) -> Message:
        """Reads generated tokens back into an assistant message, with the tool calls they make.

        See `decode_assistant_message_from_content`, which this calls on the tokens' text.

        Args:
            tokens (Sequence[int]): The answer's token IDs, with or without its final stop token.
            stop_reason (StopReason): Why generation stopped; a final `<|eot_id|>` or `<|eom_id|>` overrides it.

        Returns:
            Message: {"role": "assistant", "content", "stop_reason", "tool_calls"}.

        Raises:
            ValueError: If `stop_reason` is not one of `STOP_REASONS`.
        """
        return self.decode_assistant_message_from_content(self.tokenizer.decode(tokens), stop_reason)

    def decode_assistant_message_from_content(self, content: str, stop_reason: StopReason) -> Message:
        """Reads an answer's text into an assistant message, finding tool calls as llama-models does.

        Spaces around the text, a leading assistant header and a leading `<|python_tag|>` are removed, and a
        final `<|eot_id|>` or `<|eom_id|>` sets the stop reason. Then the first of these that matches is the
        call: `<function=name>{json}</function>`; the whole text as a JSON object with "name" and "parameters";
        the whole text as a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]` (every call is
        returned); `name.call(query="...")` anywhere in the text; and, after `<|python_tag|>`, the text as code
        for the code interpreter. A custom-tool form whose name is a built-in tool becomes that tool's call with
        {"query": first argument}. When a call is found the content is empty. Nothing is ever run, and text
        that is not a well-formed call stays content: this never raises on the text.

        Args:
            content (str): The answer as text, as `Tokenizer.decode` gives it.
            stop_reason (StopReason): Why generation stopped; a final `<|eot_id|>` or `<|eom_id|>` overrides it.

        Returns:
            Message: {"role": "assistant", "content", "stop_reason", "tool_calls"}; "tool_calls" may be empty.
                Each call has a fresh "call_id".

        Raises:
            ValueError: If `stop_reason` is not one of `STOP_REASONS` or `content` is not a str.
        """
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}, got {short_repr(stop_reason)}")
        if not isinstance(content, str):
            raise ValueError(f"content must be a str, got {type(content).__name__}")  # noqa: TRY004
        content = content.strip(" ")
        if content.startswith(_ASSISTANT_HEADER):
            content = content[len(_ASSISTANT_HEADER) :]
        python_tag = content.startswith("<|python_tag|>")
        if python_tag:
            content = content[len("<|python_tag|>") :]
        for end, reason in STOP_TOKEN_REASONS.items():
            if content.endswith(end):
                content, stop_reason = content[: -len(end)], reason
                break
        tool_calls = parse_tool_calls(content, python_tag=python_tag)
        return {
            "role": "assistant",
            "content": "" if tool_calls else content,
            "stop_reason": stop_reason,
            "tool_calls": tool_calls,
        }


_ASSISTANT_HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def _check_assistant_fields(message: Message, version: str) -> tuple[list[ToolCall], bool]:
    """A message's tool calls (checked) and whether it ends with <|eom_id|>; only assistant messages have them."""
    tool_calls = message.get("tool_calls") or []
    stop_reason = message.get("stop_reason")
    if not isinstance(tool_calls, (list, tuple)):
        raise ValueError(f"'tool_calls' must be a list of tool calls, got {type(tool_calls).__name__}")
    if message["role"] != "assistant" and (tool_calls or stop_reason is not None):
        raise ValueError(
            f"Only assistant messages carry 'tool_calls' or 'stop_reason'; this message's role is {message['role']!r}"
        )
    if stop_reason is not None and stop_reason not in STOP_REASONS:
        raise ValueError(f"'stop_reason' must be one of {STOP_REASONS}, got {short_repr(stop_reason)}")
    if version == "3" and (tool_calls or stop_reason == "end_of_message"):
        raise ValueError(
            'Tool calls and "stop_reason": "end_of_message" (<|eom_id|>) need a Tokenizer with version="3.1" '
            "(Llama 3.1 and later)"
        )
    for call in tool_calls:
        check_tool_call(call)
    return list(tool_calls), stop_reason == "end_of_message"
