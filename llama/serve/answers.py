"""The answers of `llama.serve`'s two endpoints, built from the engine's outputs: whole (one JSON body) or streamed
(server-sent events), with one choice per prompt and sample (`n`), in OpenAI's shapes. No routes here
(`llama.serve.app` has them).

A `Choice` follows one request of the engine: its text cut at stop strings, the tokens it sampled, what its prompt
reused and, when it scores its prompt (completions' `echo` with `logprobs`), the prompt tokens' logprobs. An
`Answer` gathers a response's choices, concurrently, and its usage.
"""

import asyncio
import secrets
import time
from typing import AsyncIterator, List, Optional, Tuple

from llama.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    chat_logprobs,
    completion_logprobs,
    echoed_text,
    finish_reason,
    prompt_logprobs,
    tool_calls_out,
)
from llama.serve.requests import Output
from llama.text import AnswerText
from llama.tokenizer import STOP_TOKEN_REASONS, ChatFormat, Tokenizer

# A piece of an answer: (new text, the outputs it came from, finish_reason or None).
Piece = Tuple[str, List[Output], Optional[str]]


class Choice:
    """One sampled answer to one prompt, as its outputs arrive."""

    def __init__(self, index: int, prompt: List[int], tokenizer: Tokenizer, stops: List[str]):
        self.index, self.prompt = index, prompt
        self.text = AnswerText(tokenizer, stops)
        self.sampled = 0  # tokens sampled, a final stop token included
        self.cached_tokens = 0  # of the prompt's, reused from the server's KV cache
        self.prompt_scores: Optional[list] = None  # Output.prompt_logprobs, for a prompt scored with echo

    async def pieces(self, outputs: AsyncIterator[Output]) -> AsyncIterator[Piece]:
        """A piece per token, the finish last; the prompt's scores, when they come, as a piece of no text. Leaving,
        for a stop string or any other reason, closes `outputs`, which cancels the request."""
        try:
            async for output in outputs:
                if output.finish in ("error", "cancelled"):
                    raise APIError(
                        500 if output.finish == "error" else 503,
                        "The request was stopped by a fault or a shutdown of the server",
                    )
                self.cached_tokens = output.cached_tokens
                if output.prompt_logprobs is not None:
                    self.prompt_scores = output.prompt_logprobs
                    yield "", [], None
                    continue
                if output.finish is not None:
                    self.sampled += output.finish in STOP_TOKEN_REASONS.values()  # it ended at a stop token
                    yield self.text.flush(), [], finish_reason(output.finish)
                    return
                self.sampled += 1
                piece = self.text.add(output.token)
                yield piece, [output], None
                if self.text.stopped:
                    yield "", [], "stop"
                    return
        finally:
            await outputs.aclose()


async def merged(streams: List[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The items of several streams as each comes. An error in one ends them all and is raised here."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(stream: AsyncIterator[dict]) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((None, error))
        finally:
            await queue.put((ended, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is ended:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Answer:
    """A response: one choice per prompt and sample (index prompt * n + sample), its envelope and usage."""

    kind = ""
    obj = chunk_obj = ""

    def __init__(self, tokenizer: Tokenizer, model_name: str, body: Sampling, prompts: List[List[int]]):
        self.tokenizer, self.model_name, self.body = tokenizer, model_name, body
        stops = body.stop_strings()
        self.prompts = prompts
        self.choices = [
            Choice(i * body.n + k, prompt, tokenizer, stops) for i, prompt in enumerate(prompts) for k in range(body.n)
        ]
        self.id = f"{self.kind}-{secrets.token_hex(12)}"

    def usage(self) -> dict:
        """The prompts' tokens (once each, whatever n), every token sampled, and the prompt tokens reused (by the
        first sample of each prompt: the others share its prompt)."""
        prompt_tokens = sum(len(prompt) for prompt in self.prompts)
        sampled = sum(choice.sampled for choice in self.choices)
        cached = sum(choice.cached_tokens for choice in self.choices[:: self.body.n])
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sampled,
            "total_tokens": prompt_tokens + sampled,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": int(time.time()), "model": self.model_name, "choices": choices}

    def wants_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    async def whole(self, outputs: List[AsyncIterator[Output]]) -> dict:
        """The whole response, once every choice has finished (an error in one cancels the others)."""
        tasks = [asyncio.create_task(self.choice_whole(c, o)) for c, o in zip(self.choices, outputs)]
        try:
            choices = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return {**self.envelope(self.obj, choices), "usage": self.usage()}

    async def stream(self, outputs: List[AsyncIterator[Output]]) -> AsyncIterator[dict]:
        """Chunks of every choice as they come, each with its index; then the usage, if asked for. An error ends the
        stream with OpenAI's error body."""
        streams = [self.choice_chunks(c, o) for c, o in zip(self.choices, outputs)]
        try:
            async for choice in merged(streams):
                yield self.envelope(self.chunk_obj, [choice])
        except APIError as e:
            yield e.body()
            return
        if self.wants_usage():
            yield {**self.envelope(self.chunk_obj, []), "usage": self.usage()}

    async def choice_whole(self, choice: Choice, outputs: AsyncIterator[Output]) -> dict:
        raise NotImplementedError

    def choice_chunks(self, choice: Choice, outputs: AsyncIterator[Output]) -> AsyncIterator[dict]:
        raise NotImplementedError


class ChatAnswer(Answer):
    kind, obj, chunk_obj = "chatcmpl", "chat.completion", "chat.completion.chunk"
    body: ChatRequest

    def __init__(self, formatter: ChatFormat, model_name: str, body: ChatRequest, prompt: List[int]):
        super().__init__(formatter.tokenizer, model_name, body, [prompt])
        self.formatter = formatter

    def with_tools(self) -> bool:
        return bool(self.body.tools) and self.body.tool_choice != "none"

    def logprobs(self, outputs: List[Output]) -> Optional[dict]:
        return chat_logprobs(outputs, self.tokenizer) if self.body.logprobs and outputs else None

    def message(self, text: str, reason: str) -> Tuple[dict, str]:
        """The assistant message and finish_reason, with tool calls read from the text when tools were offered."""
        calls = tool_calls_out(text, "end_of_turn", self.formatter) if self.with_tools() else None
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, reason

    async def choice_whole(self, choice: Choice, outputs: AsyncIterator[Output]) -> dict:
        texts, tokens, reason = [], [], "stop"
        async for piece, outs, finish in choice.pieces(outputs):
            texts.append(piece)
            tokens += outs
            reason = finish or reason
        message, reason = self.message("".join(texts), reason)
        logprobs = chat_logprobs(tokens, self.tokenizer) if self.body.logprobs else None
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    async def choice_chunks(self, choice: Choice, outputs: AsyncIterator[Output]) -> AsyncIterator[dict]:
        """With tools offered, the text is held until the end, when it is known whether it is a call."""

        def delta(content: dict, reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
            return {"index": choice.index, "delta": content, "logprobs": logprobs, "finish_reason": reason}

        yield delta({"role": "assistant", "content": ""})
        held, held_outputs = [], []
        async for piece, outs, finish in choice.pieces(outputs):
            if self.with_tools():
                held.append(piece)
                held_outputs += outs
            elif piece or (outs and self.body.logprobs):
                yield delta({"content": piece}, logprobs=self.logprobs(outs))
            if finish is not None:
                if self.with_tools():
                    message, finish = self.message("".join(held), finish)
                    calls = [{"index": k, **call} for k, call in enumerate(message.get("tool_calls") or [])]
                    content = {"tool_calls": calls} if calls else {"content": message["content"]}
                    yield delta(content, logprobs=self.logprobs(held_outputs))
                yield delta({}, finish)


class CompletionAnswer(Answer):
    """With `echo`, each choice's text starts with its prompt's; with `echo` and `logprobs`, its logprobs start
    with the prompt tokens' (the first one's null), which the engine scores."""

    kind, obj, chunk_obj = "cmpl", "text_completion", "text_completion"
    body: CompletionRequest

    def echoed(self, choice: Choice) -> str:
        return echoed_text(choice.prompt, self.tokenizer) if self.body.echo else ""

    def scores_prompt(self) -> bool:
        return self.body.echo and self.body.logprobs is not None

    def logprobs(self, choice: Choice, outputs: List[Output], offset: int, with_prompt: bool) -> Optional[dict]:
        """Completions' logprobs of `outputs` from text offset `offset`, after the prompt's where `with_prompt`."""
        if self.body.logprobs is None:
            return None
        if not with_prompt:
            return completion_logprobs(outputs, self.tokenizer, offset)
        scored = prompt_logprobs(choice.prompt, choice.prompt_scores, self.tokenizer, offset)
        after = completion_logprobs(outputs, self.tokenizer, offset + len(self.echoed(choice)))
        return {key: scored[key] + after[key] for key in scored}

    async def choice_whole(self, choice: Choice, outputs: AsyncIterator[Output]) -> dict:
        echoed = self.echoed(choice)
        texts, tokens, reason = [echoed], [], "stop"
        async for piece, outs, finish in choice.pieces(outputs):
            texts.append(piece)
            tokens += outs
            reason = finish or reason
        offset = 0 if self.scores_prompt() else len(echoed)
        logprobs = self.logprobs(choice, tokens, offset, with_prompt=self.scores_prompt())
        return {"index": choice.index, "text": "".join(texts), "logprobs": logprobs, "finish_reason": reason}

    async def choice_chunks(self, choice: Choice, outputs: AsyncIterator[Output]) -> AsyncIterator[dict]:
        def chunk(text: str, reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
            return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        echoed = self.echoed(choice)
        if echoed and not self.scores_prompt():
            yield chunk(echoed)
        offset, prompt_sent = len(echoed), not self.scores_prompt()
        async for piece, outs, finish in choice.pieces(outputs):
            if not prompt_sent:  # a scored prompt's piece comes first: the echoed text with its logprobs
                prompt_sent = True
                yield chunk(echoed, logprobs=self.logprobs(choice, [], 0, with_prompt=True))
            elif piece or outs or finish:
                yield chunk(piece, finish, self.logprobs(choice, outs, offset, with_prompt=False) if outs else None)
            offset += len(piece)
