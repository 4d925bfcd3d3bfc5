"""The public API: `Llama.build` loads a checkpoint and its tokenizer; `generate`, `text_completion` and
`chat_completion`, and their streaming forms, run them. Loading lives in `llama.checkpoint`, the runtime in
`llama.runtime`, decoding in `llama.decoding`, and the way between text and token IDs in `llama.text`; this class
ties them together.
"""

import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, List, Optional, Tuple, TypedDict, Union

import fairscale.nn.model_parallel.initialize as fs_init
import torch

from llama.arguments import DEFAULT_DRAFT_MAX, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.checkpoint import (
    LoadReport,
    checked_int,
    find_tokenizer,
    load_checkpoint,
)
from llama.checkpoint.draft import draft_model, draft_vocabulary
from llama.decoding import BatchDecoder, Speed, Stopwatch
from llama.decoding.grammar import constraints_for
from llama.runtime import DecodeStep, RuntimeTransformer, compiled_step, for_runtime
from llama.text import (
    StreamChunk,
    chat_prediction,
    completion_prediction,
    dialog_images,
    encode_dialogs,
    encode_prompts,
    prompt_images,
    stream_chunks,
    with_tool_calls,
)
from llama.tokenizer import ChatFormat, Dialog, Message, StopReason, Tokenizer
from llama.vision.batch import show_images
from llama.vision.model import CrossAttentionTransformer

DEFAULT_TIMEOUT = timedelta(seconds=120)


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # with logprobs=True
    logprobs: List[float]  # with logprobs=True


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # with logprobs=True
    logprobs: List[float]  # with logprobs=True
    stop_reason: StopReason  # why the answer ended (not in Meta's ChatPrediction: docs/differences.md)


class Llama:
    load_report: Optional[LoadReport] = None  # what `build` chose and how long it took
    last_speed: Optional[Speed] = None  # of the last `generate`, `text_completion` or `chat_completion` (not streams)

    @staticmethod
    def build(
        ckpt_dir: str,
        tokenizer_path: Optional[str] = None,
        max_seq_len: int = 2048,
        max_batch_size: int = 4,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        version: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        compile: Optional[bool] = None,
        quantize: Optional[str] = None,
        cuda_graphs: bool = True,
        prefix_cache: bool = False,
        draft: Optional[str] = None,
        draft_max: int = DEFAULT_DRAFT_MAX,
        draft_quantize: Optional[str] = None,
    ) -> "Llama":
        """Load a checkpoint and its tokenizer into a generator, in this process's share of the model.

        Args:
            ckpt_dir: Folder with a Meta checkpoint (params.json, consolidated.NN.pth) or a Hugging Face one
                (config.json, model*.safetensors).
            tokenizer_path: The tokenizer.model file. When None, it is looked for in ckpt_dir and ckpt_dir/original.
            max_seq_len: Longest prompt plus generation, up to the checkpoint's context (8192 for Llama 3,
                131072 for Llama 3.1 and later).
            max_batch_size: Most prompts in one call.
            model_parallel_size: Model-parallel processes; defaults to the number torchrun started.
            seed: Seed for torch's random number generators, the same in every process.
            device: "cuda", "cuda:N", "cpu" or "mps"; None picks CUDA when available, else the CPU.
            dtype: "bfloat16", "float16" or "float32"; None picks bfloat16 (or float16) on CUDA, float32 on CPU,
                and the stored dtype for Hugging Face checkpoints.
            version: "3" or "3.1": the special-token names, stop tokens and chat roles. None picks "3.1" for
                checkpoints with scaled RoPE (Llama 3.1 and later), else "3".
            timeout: How long a process waits for the others in a collective before it fails.
            compile: Decode with a compiled step (torch.compile; CUDA graphs on CUDA), see `compile_decode_step`.
                None (the default) compiles it for quantized weights on one CUDA GPU, where it decodes faster than
                the graphed step (docs/cuda.md), and nowhere else; False never compiles.
            quantize: "int8" or "int4": the linear layers' weights, quantized as they load (see docs/quantize.md);
                dtype then defaults to bfloat16 on the CPU too.
            cuda_graphs: On one CUDA GPU without `compile`, replay each batch size's decode step as a CUDA graph
                (`llama.runtime.cuda_graphs`): the eager step's logits bit for bit, one launch instead of hundreds.
                False decodes eagerly, as the reference does.
            prefix_cache: False (the default) runs every prompt from position 0, as the reference does, so the same
                seed gives the same tokens on every call. True keeps the KV cache between calls and runs only what a
                prompt adds to what its row holds (a chat's next turn: its new message): faster, the same greedy
                tokens in float32, but a prompt run in two pieces rounds otherwise, so in bfloat16 a near-tie may
                break the other way and a seeded sample may differ from a cold call's (docs/chat.md).
            draft: Decode speculatively, one prompt at a time: guess the next tokens and check up to `draft_max`
                of them in one pass, with greedy answers the model's own and samples distributed as its own
                (docs/speed.md). "lookup" guesses by prompt lookup (what followed the answer's last few tokens where
                they appeared before: faster where answers repeat their input); a checkpoint folder is a draft
                model with the same tokenizer (Llama 3.2 1B for Llama 3.1 8B; or ckpt_dir itself with
                `draft_quantize`), whose greedy tokens are the guesses. None (the default) decodes a token a step,
                as the reference does.
            draft_max: The most guessed tokens checked in one pass.
            draft_quantize: "int8" or "int4": the draft model's weights, quantized as they load.

        Returns:
            The generator. It prints nothing: its `load_report` says what was loaded, on which device, in which dtype
            and how fast, for the caller to show (docs/differences.md).

        Raises:
            FileNotFoundError: when ckpt_dir, params.json/config.json, a shard or the tokenizer is missing.
            ValueError: for arguments or checkpoints that cannot work together; the message says which.
        """
        start = time.time()
        if draft is not None:
            checked_int("draft_max", draft_max, 1)  # before anything loads
        draft_vocab = draft_vocabulary(draft)
        if draft_quantize is not None and draft_vocab is None:
            raise ValueError("draft_quantize quantizes a draft model: give its checkpoint folder as draft")
        text_only = draft_vocab is not None or compile  # options a vision model does not have
        model, tokenizer, report = load_checkpoint(
            ckpt_dir,
            tokenizer_path,
            max_seq_len,
            max_batch_size,
            model_parallel_size,
            seed,
            device,
            dtype,
            version,
            timeout,
            quantize,
            "A draft model and compile are not available with a Llama 3.2 Vision model" if text_only else None,
        )
        mp_size = fs_init.get_model_parallel_world_size()
        runtime, decode_step = for_runtime(model, compile=compile, cuda_graphs=cuda_graphs, model_parallel_size=mp_size)
        if draft_vocab is not None:
            shared_tokenizer = find_tokenizer(ckpt_dir, tokenizer_path)
            draft_args = (shared_tokenizer, max_seq_len, 1, mp_size, seed, runtime.tok_embeddings.weight.device)
            draft = draft_model(draft, draft_vocab, runtime, *draft_args, dtype, version, timeout, draft_quantize)
        # A vision model's generator holds the whole model, its text model now `runtime` (`for_runtime`).
        served = model if isinstance(model, CrossAttentionTransformer) else runtime
        generator = Llama(served, tokenizer, decode_step, prefix_cache, draft, draft_max)
        report.seconds = time.time() - start  # with the runtime's choices
        report.kernels = getattr(runtime, "kernels_in_use", None)
        generator.load_report = report
        return generator

    def __init__(
        self,
        model: RuntimeTransformer,
        tokenizer: Tokenizer,
        decode_step: Optional[DecodeStep] = None,
        prefix_cache: bool = False,
        draft: Union[str, RuntimeTransformer, None] = None,
        draft_max: int = DEFAULT_DRAFT_MAX,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = ChatFormat(tokenizer)
        # A vision model decodes through its text model, which reads the images `show_images` gives it.
        decoding = model.text_model if isinstance(model, CrossAttentionTransformer) else model
        self.decoder = BatchDecoder(decoding, tokenizer, decode_step, prefix_cache, draft, draft_max)

    def compile_decode_step(self) -> None:
        """From now on, decode one token per row with `Transformer.decode_step` compiled by torch.compile.

        One compiled graph serves every position, prompt and output length (on CUDA, replayed as a CUDA graph); the
        first call of each batch size compiles it, and prompts still run through `Transformer.forward`. The same
        math summed in another order: float32 keeps the eager path's tokens, bfloat16 may break near ties otherwise.
        On the CPU, an int8 model's step of one sequence holds its weights frozen in (a copy of its own, faster to
        multiply): a weight edited in place afterwards is not seen by it (docs/speed.md).

        Raises:
            ValueError: for a Llama 3.2 Vision model, which decodes eagerly (docs/vision.md).
        """
        if isinstance(self.model, CrossAttentionTransformer):
            raise ValueError("A Llama 3.2 Vision model decodes eagerly: its decode step cannot be compiled")
        self.decoder.decode_step = compiled_step(self.model)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def decode_step(self) -> Optional[DecodeStep]:
        """The one-token step decoding runs: compiled, or replayed as CUDA graphs; None: the eager step."""
        return self.decoder.decode_step

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: Optional[int],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        logprobs: bool = False,
        echo: bool = False,
    ) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
        """Generate token sequences for a batch of tokenized prompts.

        Args:
            prompt_tokens: One list of token IDs per prompt.
            max_gen_len: The most tokens to generate per prompt; None means max_seq_len - 1.
            temperature: Softmax temperature; 0 means greedy decoding.
            top_p: Nucleus sampling threshold, in (0, 1].
            logprobs: Also return each output token's log-probability.
            echo: Include the prompt tokens in the output.

        Returns:
            The generated tokens per prompt, cut before the first stop token, and their logprobs if asked for.

        Raises:
            ValueError: for an empty batch or prompt, a batch or prompt that is too long, or a bad parameter.
        """
        with self.images_seen(prompt_tokens, [], max_gen_len, temperature, top_p):  # token IDs: no image
            return self.run_batch(prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo)

    @contextmanager
    def images_seen(self, prompt_tokens, images, max_gen_len, temperature, top_p) -> Iterator[None]:
        """While a batch runs, its images shown to a vision model (`show_images`), once the checks that cost nothing
        have passed; and taken away after it, even on an error, so that no later call sees them or keeps their
        keys and values in memory."""
        if any(images):
            self.decoder.checked_prompts(prompt_tokens, self.decoder.gen_len(max_gen_len), temperature, top_p)
        show_images(self.model, prompt_tokens, images)
        try:
            yield
        finally:
            show_images(self.model, prompt_tokens, [])

    def run_batch(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: Optional[int],
        temperature: float,
        top_p: float,
        logprobs: bool,
        echo: bool,
    ) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
        """`generate`, inside `images_seen`."""
        max_gen_len = self.decoder.gen_len(max_gen_len)
        stopwatch = Stopwatch(self.decoder)
        out_tokens, out_logprobs, _ = self.decoder.run(prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo)
        new_tokens = sum(max(len(t) - (len(p) if echo else 0), 0) for t, p in zip(out_tokens, prompt_tokens))
        self.last_speed = stopwatch.speed(new_tokens)
        return out_tokens, out_logprobs if logprobs else None

    def text_completion(
        self,
        prompts: List[str],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
    ) -> List[CompletionPrediction]:
        """Complete each text prompt.

        Args:
            prompts: The texts to complete.
            temperature: Softmax temperature; 0 means greedy decoding.
            top_p: Nucleus sampling threshold, in (0, 1].
            max_gen_len: The most tokens to generate; None means max_seq_len - 1.
            logprobs: Also return each generated token's text and log-probability.
            echo: Include the prompt in the generation.

        Returns:
            One CompletionPrediction per prompt: {"generation": text}, plus "tokens" and "logprobs" if asked for.

        Raises:
            ValueError: for an empty list, an empty prompt, too many or too long prompts, or a bad parameter.
        """
        prompt_tokens = encode_prompts(self.tokenizer, prompts)
        with self.images_seen(prompt_tokens, prompt_images(prompts), max_gen_len, temperature, top_p):
            generation_tokens, generation_logprobs = self.run_batch(
                prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo
            )
        per_row = generation_logprobs or [None] * len(generation_tokens)
        return [completion_prediction(self.tokenizer, t, p) for t, p in zip(generation_tokens, per_row)]

    @torch.inference_mode()
    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        response_format: Optional[dict] = None,
    ) -> List[ChatPrediction]:
        """Answer each dialog as the assistant.

        Args:
            dialogs: Conversations, each a list of {"role", "content"} messages (tool calls: see docs/tools.md).
            temperature: Softmax temperature; 0 means greedy decoding.
            top_p: Nucleus sampling threshold, in (0, 1].
            max_gen_len: The most tokens to generate; None means max_seq_len - 1.
            logprobs: Also return each generated token's text and log-probability.
            response_format: Not in Meta's API; OpenAI's shape: {"type": "json_object"} or {"type": "json_schema",
                "json_schema": {"schema": {...}}} decodes under a grammar (llguidance), so the answer is such JSON
                (docs/serve.md).

        Returns:
            One ChatPrediction per dialog: {"generation": {"role": "assistant", "content": text},
            "stop_reason": "end_of_turn" | "end_of_message" | "length"}, plus "tokens" and "logprobs" if asked for.
            When a Llama 3.1+ model calls tools, the generation also has "stop_reason" and "tool_calls".

        Raises:
            ValueError: for an empty list or dialog, a malformed message, too many or too long dialogs, a bad value.
        """
        prompt_tokens = encode_dialogs(self.formatter, dialogs)
        stopwatch = Stopwatch(self.decoder)
        rows = constraints_for(response_format, self.tokenizer, self.model.params.vocab_size, len(dialogs))
        with self.images_seen(prompt_tokens, dialog_images(dialogs), max_gen_len, temperature, top_p):
            generation_tokens, generation_logprobs, stop_reasons = self.decoder.run(
                prompt_tokens, self.decoder.gen_len(max_gen_len), temperature, top_p, logprobs, False, rows
            )
        self.last_speed = stopwatch.speed(sum(len(t) for t in generation_tokens))
        rows = zip(generation_tokens, generation_logprobs, stop_reasons)
        return [chat_prediction(self.formatter, t, p, reason) for t, p, reason in rows]

    @torch.inference_mode()
    def text_completion_stream(
        self,
        prompts: List[str],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Like `text_completion`, but yields each prompt's new text as soon as it can be decoded.

        Chunks of different prompts interleave; join the `text` of one `index` to get its whole generation,
        which equals `text_completion`'s for the same seed. A chunk never ends inside a multi-byte character.
        Each prompt's last chunk has `finished=True` and its `stop_reason`.

        Raises:
            ValueError: as `text_completion`.
        """
        prompt_tokens = encode_prompts(self.tokenizer, prompts)
        with self.images_seen(prompt_tokens, prompt_images(prompts), max_gen_len, temperature, top_p):
            tokens = self.decoder.stream(prompt_tokens, self.decoder.gen_len(max_gen_len), temperature, top_p)
            yield from stream_chunks(self.tokenizer, tokens)

    @torch.inference_mode()
    def chat_completion_stream(
        self,
        dialogs: List[Dialog],
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_gen_len: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Like `chat_completion`, but yields each answer's new text as soon as it can be decoded.

        See `text_completion_stream` for the chunks; joined, they are the answer's text (`chat_completion`'s
        content unless it calls tools), and with Llama 3.1+ the last one carries the answer's `tool_calls`, if any.

        Raises:
            ValueError: as `chat_completion`.
        """
        prompt_tokens = encode_dialogs(self.formatter, dialogs)
        with self.images_seen(prompt_tokens, dialog_images(dialogs), max_gen_len, temperature, top_p):
            tokens = self.decoder.stream(prompt_tokens, self.decoder.gen_len(max_gen_len), temperature, top_p)
            yield from with_tool_calls(self.formatter, stream_chunks(self.tokenizer, tokens))
