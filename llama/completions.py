"""Between the completion calls' text and token IDs: prompts and dialogs checked and encoded, answers read back
into the reference's shapes."""

from typing import List, Optional

from llama.structured import Grammar
from llama.tokenizer import ChatFormat, Dialog, Message, StopReason, Tokenizer


def encode_prompts(tokenizer: Tokenizer, prompts: List[str]) -> List[List[int]]:
    """Each prompt's tokens, after a beginning-of-text token; a ValueError names a prompt that cannot work."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings; wrap a single prompt in a list: [prompt]")
    if not prompts:
        raise ValueError("No prompts given; pass a list with at least one prompt")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"Prompt {i} is {'empty' if prompt == '' else 'not a string'}: {prompt!r}")
    return [tokenizer.encode(x, bos=True, eos=False) for x in prompts]


def encode_dialogs(formatter: ChatFormat, dialogs: List[Dialog]) -> List[List[int]]:
    """Each dialog in the chat format, ending where the assistant's answer starts; a ValueError names a dialog
    that cannot work."""
    if not dialogs:
        raise ValueError("No dialogs given; pass a list with at least one dialog")
    for i, dialog in enumerate(dialogs):
        if isinstance(dialog, dict):
            raise ValueError("dialogs must be a list of dialogs (lists of messages); wrap one dialog in a list")
        if not dialog:
            raise ValueError(f"Dialog {i} is empty; give it at least one message")
    return [formatter.encode_dialog_prompt(dialog) for dialog in dialogs]


def assistant_message(formatter: ChatFormat, tokens: List[int], stop_reason: StopReason) -> Message:
    """The "generation" of one answer: {"role": "assistant", "content": its text}, as the reference gives it. With
    Llama 3.1+ tokens, an answer that calls tools is the message `ChatFormat.decode_assistant_message` reads instead:
    empty content, "stop_reason" and "tool_calls" (llama.tools runs them; nothing here does)."""
    content = formatter.tokenizer.decode(tokens)
    if formatter.tokenizer.version != "3":
        message = formatter.decode_assistant_message_from_content(content, stop_reason)
        if message["tool_calls"]:
            return message
    return {"role": "assistant", "content": content}


def token_logprobs(tokenizer: Tokenizer, tokens: List[int], logprobs: List[float]) -> dict:
    """The "tokens" (each decoded alone) and "logprobs" entries of a prediction."""
    return {"tokens": [tokenizer.decode([x]) for x in tokens], "logprobs": logprobs}


def completion_prediction(tokenizer: Tokenizer, tokens: List[int], logprobs: Optional[List[float]]) -> dict:
    """One prompt's `CompletionPrediction`: {"generation": text}, with "tokens" and "logprobs" given logprobs."""
    prediction = {"generation": tokenizer.decode(tokens)}
    if logprobs is not None:
        prediction.update(token_logprobs(tokenizer, tokens, logprobs))
    return prediction


def chat_prediction(
    formatter: ChatFormat, tokens: List[int], logprobs: Optional[List[float]], stop_reason: StopReason
) -> dict:
    """One dialog's `ChatPrediction`: its "generation" (`assistant_message`), "tokens" and "logprobs" when there are
    logprobs, and "stop_reason"."""
    prediction = {"generation": assistant_message(formatter, tokens, stop_reason)}
    if logprobs is not None:
        prediction.update(token_logprobs(formatter.tokenizer, tokens, logprobs))
    prediction["stop_reason"] = stop_reason
    return prediction


def constraints_for(
    response_format: Optional[dict], tokenizer: Tokenizer, vocab_size: int, rows: int
) -> Optional[list]:
    """A grammar's constraint (`llama.structured.Constraint`) per row for an OpenAI-style `response_format`, or
    None for free text."""
    if response_format is None:
        return None
    grammar = Grammar.from_response_format(response_format, tokenizer, vocab_size)
    return None if grammar is None else [grammar.start() for _ in range(rows)]
