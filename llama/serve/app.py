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
from typing import Any, AsyncIterator, Callable, List, Optional, Sequence, Type, TypeVar, Union

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from llama.decoding.grammar import Grammar, GrammarError
from llama.serve import engine as batching
from llama.serve.answers import Answer, ChatAnswer, CompletionAnswer
from llama.serve.engine import Engine
from llama.serve.prompts import answer_format, check_in_vocabulary, completion_prompts, dialog_of, tokenize
from llama.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    Sampling,
    TokenizeChat,
    TokenizePrompt,
)
from llama.serve.requests import Output, QueueFull
from llama.text import dialog_images
from llama.tokenizer import ChatFormat, Message, Tokenizer
from llama.vision.batch import ImageTiles

# How often a request checks that its client is still there.
DISCONNECT_POLL_S = 0.2
# Larger bodies are refused before they are read whole (a prompt of max_seq_len tokens is far smaller).
MAX_BODY_BYTES = 16 * 2**20
# A vision model's: room for the base64 of four photos (`llama.vision.batch.MAX_IMAGES`) of up to 12 MiB each.
VISION_MAX_BODY_BYTES = 64 * 2**20

M = TypeVar("M", bound=BaseModel)


class Service:
    """What the routes need: the engine and its thread, the tokenizer, the name the model is served under, and
    whether the engine's model takes images (Llama 3.2 Vision), which also sets the largest body a request may have."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.takes_images = engine.takes_images
        self.max_body_bytes = VISION_MAX_BODY_BYTES if self.takes_images else MAX_BODY_BYTES
        self.formatter = ChatFormat(tokenizer)
        self.created = int(time.time())
        self.thread = threading.Thread(target=engine.run, name="engine", daemon=True)

    async def grammar(self, body: Sampling) -> Optional[Grammar]:
        """The grammar a request's answers must follow (`answer_format`), compiled (APIError 400 if it cannot be)."""
        response_format = answer_format(body)
        if response_format is None:
            return None
        vocab_size = self.engine.model.params.vocab_size
        try:
            return await run_in_threadpool(Grammar.from_response_format, response_format, self.tokenizer, vocab_size)
        except (GrammarError, ImportError) as e:
            raise APIError(400, str(e), "response_format") from None

    def prompt_room(self, prompt: List[int], max_tokens: Optional[int], where: str) -> int:
        """max_tokens, or all the room left after the prompt; APIError (400) when they do not fit."""
        limit = self.engine.max_seq_len
        if len(prompt) >= limit + (max_tokens == 0):  # max_tokens=0 scores the prompt alone: it may fill the window
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

    def image_inputs(self, dialog: List[Message]) -> List[ImageTiles]:
        """The images of a dialog (`dialog_of`'s, opened), tiled as the vision model takes them; a ValueError for
        one too long and thin to tile."""
        return [self.engine.model.image_input(image) for image in dialog_images([dialog])[0]]

    def submit(
        self,
        http: Request,
        answer: Answer,
        max_tokens: List[int],
        top_logprobs: Optional[int],
        score_prompt: bool = False,
        grammar: Optional[Grammar] = None,
        images: Sequence[ImageTiles] = (),
    ) -> List[AsyncIterator[Output]]:
        """Queue a request per choice of `answer` now (all or none: APIError 429 when the queue is full), with
        `max_tokens` per prompt; return each one's outputs as they will come. Leaving them early (a stop string, a
        client gone) cancels the request. Sample k of a seeded request draws with seed + k. Each answer follows
        `grammar`, if any, and sees `images` (`image_inputs`)."""
        loop, body = asyncio.get_running_loop(), answer.body
        requests, queues = [], []
        for choice in answer.choices:
            queue, sample = asyncio.Queue(), choice.index % body.n
            requests.append(
                batching.Request(
                    choice.prompt,
                    max_tokens[choice.index // body.n],
                    body.temperature,
                    body.top_p,
                    emit=lambda out, queue=queue: loop.call_soon_threadsafe(queue.put_nowait, out),
                    seed=None if body.seed is None else body.seed + sample,
                    top_logprobs=top_logprobs,
                    score_prompt=score_prompt,
                    constraint=None if grammar is None else grammar.start(),
                    images=list(images),
                )
            )
            queues.append(queue)
        for n, request in enumerate(requests):
            try:
                self.engine.submit(request)
            except QueueFull as e:
                for queued in requests[:n]:
                    self.engine.cancel(queued)
                raise APIError(429, f"The server is busy: {e}; retry later", code="queue_full") from None
        return [self.outputs(http, request, queue) for request, queue in zip(requests, queues)]

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


async def parse(http: Request, model: Union[Type[M], Callable[[Any], Type[M]]], max_bytes: int) -> M:
    """The request's JSON body, whatever its Content-Type, checked against `model` (or the model that `model`
    picks for the decoded body); an APIError (400) names the first problem and the field it concerns, an APIError
    (413) a body over `max_bytes`."""
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > max_bytes:
            raise APIError(413, f"The request body is over {max_bytes} bytes", code="request_too_large")
    try:
        data = json.loads(body)
        if not isinstance(model, type):
            model = model(data)
        return model.model_validate(data)
    except RecursionError:  # json's and pydantic's own limit on nested arrays and objects, not a fault of ours
        raise APIError(400, "The request body nests arrays or objects too deeply to read") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    except ValidationError as e:
        problem = e.errors()[0]
        param = ".".join(str(part) for part in problem["loc"]) or None
        if problem["type"] == "extra_forbidden":
            raise APIError(400, f"Unknown field {param!r}: this server does not take it", param) from None
        raise APIError(400, f"{param or 'The request body'}: {problem['msg']}", param) from None


def tokenize_model(data: Any) -> type:
    """Which /tokenize body `data` is: chat messages or a text."""
    return TokenizeChat if isinstance(data, dict) and "messages" in data else TokenizePrompt


ERROR_STATUSES = {
    400: "A malformed body, a field out of range, a prompt that does not fit",
    401: "A missing or wrong API key (where the server has one)",
    404: "Another model's name",
    413: f"A body over {MAX_BODY_BYTES} bytes ({VISION_MAX_BODY_BYTES} for a model that takes images)",
    429: "Every row busy and the queue full",
    503: "The server shut down before the answer was done",
}


def errors(*statuses: int) -> dict:
    """The OpenAPI `responses` of these error statuses, each with OpenAI's error body."""
    return {status: {"model": ErrorBody, "description": ERROR_STATUSES[status]} for status in statuses}


def json_body(*models: Type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses its body itself (`parse`), one of `models`, for
    `openapi_extra`."""
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def with_body_schemas(app: FastAPI, models: List[Type[BaseModel]], model_name: str) -> None:
    """Make `app`'s OpenAPI schema hold the request models that `json_body` refers to, their `model` field the one
    name served (any other is a 404)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                if issubclass(model, Sampling):
                    model_schema["properties"]["model"] = {"type": "string", "enum": [model_name]}
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


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

    # vLLM's tokenizer endpoints, at the root and without the API key as vLLM has them (lm-eval's remote tokenizer).
    @app.post("/tokenize", openapi_extra=json_body(TokenizePrompt, TokenizeChat), responses=errors(400, 413))
    async def tokenize_route(http: Request):
        body = await parse(http, tokenize_model, service.max_body_bytes)
        try:
            tokens = await run_in_threadpool(tokenize, body, service.formatter, service.takes_images)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        strs = [service.tokenizer.decode_bytes([t]).decode("utf-8", errors="replace") for t in tokens]
        return {
            "count": len(tokens),
            "max_model_len": service.engine.max_seq_len,
            "tokens": tokens,
            "token_strs": strs if body.return_token_strs else None,
        }

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=errors(400, 413))
    async def detokenize(http: Request):
        body = await parse(http, DetokenizeRequest, service.max_body_bytes)
        check_in_vocabulary(body.tokens, service.engine.model.params.vocab_size, "tokens")
        return {"prompt": service.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        special = {v: k for k, v in service.tokenizer.special_tokens.items()}
        return {
            "tokenizer_class": "Llama3Tokenizer (tiktoken BPE)",
            "bos_token": special[service.tokenizer.bos_id],
            "eos_token": special[service.tokenizer.eos_id],
            "pad_token": None,
            "stop_tokens": sorted(special[t] for t in service.tokenizer.stop_tokens),
            "model_max_length": service.engine.max_seq_len,
            "vocab_size": service.engine.model.params.vocab_size,
        }

    @app.get("/v1/models", dependencies=guarded, responses=errors(401))
    async def models():
        model = {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "llama"}
        # The inputs the model reads, under OpenRouter's name for them (OpenAI's model object has no such field).
        model["input_modalities"] = ["text", "image"] if service.takes_images else ["text"]
        return {"object": "list", "data": [model]}

    streamed = {"description": "The answer; with stream, server-sent events", "content": {"text/event-stream": {}}}
    completion_errors = {200: streamed, **errors(400, 401, 404, 413, 429, 503)}

    @app.post(
        "/v1/chat/completions", dependencies=guarded, openapi_extra=json_body(ChatRequest), responses=completion_errors
    )
    async def chat_completions(http: Request):
        body = await parse(http, ChatRequest, service.max_body_bytes)
        check_model(body)
        try:  # in worker threads: a long prompt, or images to decode, must not stall the other requests' streams
            dialog = await run_in_threadpool(dialog_of, body, service.formatter, service.takes_images)
            prompt = await run_in_threadpool(service.formatter.encode_dialog_prompt, dialog)
            images = await run_in_threadpool(service.image_inputs, dialog)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        max_tokens = service.prompt_room(prompt, body.max_completion_tokens or body.max_tokens, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        # Made before the engine gets the request: this checks `stop` too.
        chat = ChatAnswer(service.formatter, service.model_name, body, prompt)
        outputs = service.submit(http, chat, [max_tokens], top, grammar=await service.grammar(body), images=images)
        if body.stream:
            return event_stream(chat.stream(outputs))
        return await chat.whole(outputs)

    @app.post(
        "/v1/completions", dependencies=guarded, openapi_extra=json_body(CompletionRequest), responses=completion_errors
    )
    async def completions(http: Request):
        body = await parse(http, CompletionRequest, service.max_body_bytes)
        check_model(body)
        vocab_size = service.engine.model.params.vocab_size
        prompts = await run_in_threadpool(completion_prompts, body.prompt, service.tokenizer, vocab_size)
        max_tokens = [service.prompt_room(prompt, body.max_tokens, "prompt") for prompt in prompts]
        completion = CompletionAnswer(service.tokenizer, service.model_name, body, prompts)
        scored = body.echo and body.logprobs is not None  # each prompt token's logprob too
        grammar = await service.grammar(body)
        outputs = service.submit(http, completion, max_tokens, body.logprobs, score_prompt=scored, grammar=grammar)
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

    bodies = [ChatRequest, CompletionRequest, TokenizePrompt, TokenizeChat, DetokenizeRequest]
    with_body_schemas(app, bodies, service.model_name)
    return app


def event_stream(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: each dict as a `data:` line, then `data: [DONE]`."""

    async def lines():
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
