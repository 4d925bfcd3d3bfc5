"""The HTTP side of `llama.serve`: a FastAPI app with OpenAI's endpoints over an `Engine` that runs in a thread of
its own. Each request waits on an asyncio queue that the engine's thread fills; a client that goes away cancels
its request, which frees its row at the engine's next step.
"""

import asyncio
import json
import secrets
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, List, Optional, Tuple, Type, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llama import engine as batching
from llama.engine import Engine, Output, QueueFull
from llama.openai_api import (
    AnswerText,
    APIError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    chat_logprobs,
    completion_logprobs,
    dialog_of,
    finish_reason,
    tool_calls_out,
)
from llama.tokenizer import STOP_TOKEN_REASONS, ChatFormat, Tokenizer

# How often a request checks that its client is still there.
DISCONNECT_POLL_S = 0.2
# Larger bodies are refused before they are read whole (a prompt of max_seq_len tokens is far smaller).
MAX_BODY_BYTES = 16 * 2**20

M = TypeVar("M", bound=BaseModel)


class Service:
    """What the routes need: the engine and its thread, the tokenizer, and the name the model is served under."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.formatter = ChatFormat(tokenizer)
        self.created = int(time.time())
        self.thread = threading.Thread(target=engine.run, name="engine", daemon=True)

    def prompt_room(self, prompt: List[int], max_tokens: Optional[int], where: str) -> int:
        """max_tokens, or all the room left after the prompt; APIError (400) when they do not fit."""
        limit = self.engine.max_seq_len
        if len(prompt) >= limit:
            raise APIError(
                400,
                f"The prompt is {len(prompt)} tokens long; this server's max_seq_len is {limit}, "
                "which must also hold at least one new token",
                where,
                "context_length_exceeded",
            )
        if max_tokens is not None and len(prompt) + max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} after a prompt of {len(prompt)} tokens exceeds "
                f"max_seq_len={limit}; ask for at most {limit - len(prompt)}",
                "max_tokens",
                "context_length_exceeded",
            )
        return limit - len(prompt) if max_tokens is None else max_tokens

    def submit(
        self, http: Request, prompt: List[int], max_tokens: int, body: Sampling, top_logprobs: Optional[int]
    ) -> AsyncIterator[Output]:
        """Queue one prompt now (APIError 429 when the queue is full); return its outputs as they will come.
        Leaving them early (a stop string, a client gone) cancels the request."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        request = batching.Request(
            prompt,
            max_tokens,
            body.temperature,
            body.top_p,
            emit=lambda out: loop.call_soon_threadsafe(queue.put_nowait, out),
            seed=body.seed,
            top_logprobs=top_logprobs,
        )
        try:
            self.engine.submit(request)
        except QueueFull as e:
            raise APIError(429, f"The server is busy: {e}; retry later", code="queue_full") from None
        return self.outputs(http, request, queue)

    async def outputs(self, http: Request, request: batching.Request, queue: asyncio.Queue) -> AsyncIterator[Output]:
        try:
            checked = time.monotonic()
            while True:
                if time.monotonic() - checked > DISCONNECT_POLL_S:
                    if await http.is_disconnected():
                        return
                    checked = time.monotonic()
                try:
                    output = queue.get_nowait()  # no task for wait_for to make while outputs are there
                except asyncio.QueueEmpty:
                    try:
                        output = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        continue
                yield output
                if output.finish is not None:
                    return
        finally:
            self.engine.cancel(request)  # nothing once it has finished; frees its row otherwise


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def parse(http: Request, model: Type[M]) -> M:
    """The request's JSON body, whatever its Content-Type, checked against `model`; an APIError (400) names the
    first problem and the field it concerns."""
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"The request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        return model.model_validate(json.loads(body))
    except json.JSONDecodeError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    except ValidationError as e:
        problem = e.errors()[0]
        param = ".".join(str(part) for part in problem["loc"]) or None
        if problem["type"] == "extra_forbidden":
            raise APIError(400, f"Unknown field {param!r}: this server does not take it", param) from None
        raise APIError(400, f"{param or 'The request body'}: {problem['msg']}", param) from None


def create_app(service: Service, api_key: Optional[str] = None) -> FastAPI:
    """The app: POST /v1/chat/completions and /v1/completions, GET /v1/models (behind `api_key` when given) and
    GET /health. The engine's thread starts with the app and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.thread.start()
        yield
        service.engine.stop()
        service.thread.join()

    def check_key(http: Request) -> None:
        if api_key is None:
            return
        given = http.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    app = FastAPI(title="llama", lifespan=lifespan)
    guarded = [Depends(check_key)]
    app.add_exception_handler(APIError, lambda _, exc: error_response(exc))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_name, **service.engine.load()}

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        model = {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "llama"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(http: Request):
        body = await parse(http, ChatRequest)
        check_model(body)
        try:  # in a worker thread: a long prompt must not stall the other requests' streams
            prompt = await run_in_threadpool(service.formatter.encode_dialog_prompt, dialog_of(body, service.formatter))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        max_tokens = service.prompt_room(prompt, body.max_completion_tokens or body.max_tokens, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        chat = ChatAnswer(service, body, len(prompt))  # before the engine gets it: this checks `stop` too
        outputs = service.submit(http, prompt, max_tokens, body, top)
        if body.stream:
            return event_stream(chat.stream(outputs))
        return await chat.whole(outputs)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(http: Request):
        body = await parse(http, CompletionRequest)
        check_model(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1 or not prompts[0]:
            raise APIError(400, "Send one non-empty prompt per request", "prompt")
        prompt = await run_in_threadpool(service.tokenizer.encode, prompts[0], bos=True, eos=False)
        max_tokens = service.prompt_room(prompt, body.max_tokens, "prompt")
        completion = CompletionAnswer(service, body, prompts[0], len(prompt))
        outputs = service.submit(http, prompt, max_tokens, body, body.logprobs)
        if body.stream:
            return event_stream(completion.stream(outputs))
        return await completion.whole(outputs)

    def check_model(body: Sampling) -> None:
        if body.model != service.model_name:
            raise APIError(
                404,
                f"The model {body.model!r} is not served here; this server serves {service.model_name!r}",
                "model",
                "model_not_found",
            )

    return app


def event_stream(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: each dict as a `data:` line, then `data: [DONE]`."""

    async def lines():
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


class Answer:
    """What both endpoints do with an answer's outputs: text cut at stop strings, logprobs, usage."""

    kind = ""

    def __init__(self, service: Service, body: Sampling, prompt_tokens: int):
        self.service, self.body = service, body
        self.text = AnswerText(service.tokenizer, body.stop_strings())
        self.id = f"{self.kind}-{secrets.token_hex(12)}"
        self.prompt_tokens, self.sampled = prompt_tokens, 0
        self.cached_tokens = 0  # of the prompt's, reused from the server's KV cache

    async def pieces(self, outputs: AsyncIterator[Output]) -> AsyncIterator[Tuple[str, List[Output], Optional[str]]]:
        """(new text, the outputs it came from, finish_reason or None) per token, the finish last. Leaving, for a
        stop string or any other reason, closes `outputs`, which cancels the request."""
        try:
            async for output in outputs:
                if output.finish in ("error", "cancelled"):
                    raise APIError(
                        500 if output.finish == "error" else 503,
                        "The request was stopped by a fault or a shutdown of the server",
                    )
                self.cached_tokens = output.cached_tokens
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

    def usage(self) -> dict:
        total = self.prompt_tokens + self.sampled
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.sampled,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": int(time.time()),
            "model": self.service.model_name,
            "choices": choices,
        }

    def wants_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)


class ChatAnswer(Answer):
    kind = "chatcmpl"

    def with_tools(self) -> bool:
        return bool(self.body.tools) and self.body.tool_choice != "none"

    def logprobs(self, outputs: List[Output]) -> Optional[dict]:
        return chat_logprobs(outputs, self.service.tokenizer) if self.body.logprobs and outputs else None

    def message(self, text: str, reason: str) -> Tuple[dict, str]:
        """The assistant message and finish_reason, with tool calls read from the text when tools were offered."""
        calls = tool_calls_out(text, "end_of_turn", self.service.formatter) if self.with_tools() else None
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, reason

    async def whole(self, outputs: AsyncIterator[Output]) -> dict:
        texts, tokens, reason = [], [], "stop"
        async for piece, outs, finish in self.pieces(outputs):
            texts.append(piece)
            tokens += outs
            reason = finish or reason
        message, reason = self.message("".join(texts), reason)
        logprobs = chat_logprobs(tokens, self.service.tokenizer) if self.body.logprobs else None
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {**self.envelope("chat.completion", [choice]), "usage": self.usage()}

    async def stream(self, outputs: AsyncIterator[Output]) -> AsyncIterator[dict]:
        """Chunks of OpenAI's chat stream. With tools offered, the text is held until the end, when it is known
        whether it is a call."""

        def chunk(delta: dict, reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return self.envelope("chat.completion.chunk", [choice])

        yield chunk({"role": "assistant", "content": ""})
        held, held_outputs = [], []
        try:
            async for piece, outs, finish in self.pieces(outputs):
                if self.with_tools():
                    held.append(piece)
                    held_outputs += outs
                elif piece or (outs and self.body.logprobs):
                    yield chunk({"content": piece}, logprobs=self.logprobs(outs))
                if finish is not None:
                    if self.with_tools():
                        message, finish = self.message("".join(held), finish)
                        calls = [{"index": k, **call} for k, call in enumerate(message.get("tool_calls") or [])]
                        delta = {"tool_calls": calls} if calls else {"content": message["content"]}
                        yield chunk(delta, logprobs=self.logprobs(held_outputs))
                    yield chunk({}, finish)
        except APIError as e:
            yield e.body()
            return
        if self.wants_usage():
            yield {**self.envelope("chat.completion.chunk", []), "usage": self.usage()}


class CompletionAnswer(Answer):
    kind = "cmpl"

    def __init__(self, service: Service, body: CompletionRequest, prompt: str, prompt_tokens: int):
        super().__init__(service, body, prompt_tokens)
        self.echoed = prompt if body.echo else ""

    def logprobs(self, outs: List[Output], offset: int) -> Optional[dict]:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(outs, self.service.tokenizer, offset)

    async def whole(self, outputs: AsyncIterator[Output]) -> dict:
        texts, tokens, reason = [self.echoed], [], "stop"
        async for piece, outs, finish in self.pieces(outputs):
            texts.append(piece)
            tokens += outs
            reason = finish or reason
        choice = {
            "index": 0,
            "text": "".join(texts),
            "logprobs": self.logprobs(tokens, len(self.echoed)),
            "finish_reason": reason,
        }
        return {**self.envelope("text_completion", [choice]), "usage": self.usage()}

    async def stream(self, outputs: AsyncIterator[Output]) -> AsyncIterator[dict]:
        def chunk(text: str, reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
            return self.envelope(
                "text_completion", [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}]
            )

        if self.echoed:
            yield chunk(self.echoed)
        offset = len(self.echoed)
        try:
            async for piece, outs, finish in self.pieces(outputs):
                if piece or outs or finish:
                    yield chunk(piece, finish, self.logprobs(outs, offset) if outs else None)
                offset += len(piece)
        except APIError as e:
            yield e.body()
            return
        if self.wants_usage():
            yield {**self.envelope("text_completion", []), "usage": self.usage()}
