"""Tokens back into answers: each generated answer in the reference's shapes (`completion_prediction`,
`chat_prediction`), with the tool calls a Llama 3.1+ answer makes read out of its text (`tool_call_message`)."""

from typing import List, Optional

from llama.tokenizer import ChatFormat, Message, StopReason, Tokenizer


def tool_call_message(formatter: ChatFormat, text: str, stop_reason: StopReason) -> Optional[Message]:
    """The message of an answer that calls tools, as `ChatFormat.decode_assistant_message_from_content` reads its
    whole text (Llama 3.1+ tokens): empty content, "stop_reason" and "tool_calls". None where it calls none, and for
    Llama 3 tokens, which have no tool calls. The one place where generated text is read for tool calls: the
    library's answers and streams and the server's answers all ask here (llama.tools runs the calls; nothing here
    does)."""
    if formatter.tokenizer.version == "3":
        return None
    message = formatter.decode_assistant_message_from_content(text, stop_reason)
    return message if message["tool_calls"] else None


def assistant_message(formatter: ChatFormat, tokens: List[int], stop_reason: StopReason) -> Message:
    """The "generation" of one answer: {"role": "assistant", "content": its text}, as the reference gives it, or,
    where it calls tools, its `tool_call_message`."""
    content = formatter.tokenizer.decode(tokens)
    return tool_call_message(formatter, content, stop_reason) or {"role": "assistant", "content": content}


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
