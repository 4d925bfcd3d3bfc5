# Copyright (c) Meta Platforms, Inc. and affiliates.
# This software may be used and distributed in accordance with the terms of the Llama 3 Community License Agreement.

import codecs
import functools
import itertools
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator, List, Literal, Optional, Tuple, TypedDict, Union

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.nn.functional as F

from llama.checkpoint import load_model, model_args_from, open_checkpoint
from llama.distributed import init_model_parallel, resolve_device, resolve_dtype
from llama.model import Transformer
from llama.parallel_layers import use_parallel_layers
from llama.tokenizer import ChatFormat, Dialog, Message, Tokenizer

LLAMA3_CONTEXT = 8192
SCALED_ROPE_CONTEXT = 131072  # Llama 3.1 and later
DEFAULT_TIMEOUT = timedelta(seconds=120)

StopReason = Literal["end_of_turn", "end_of_message", "length"]


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # not required
    logprobs: List[float]  # not required
    stop_reason: StopReason  # ours: why the answer ended


@dataclass
class StreamChunk:
    """New text for one prompt of a streaming call."""

    index: int  # which prompt or dialog of the batch
    text: str  # decoded text since this prompt's previous chunk
    finished: bool = False  # this prompt's last chunk
    stop_reason: Optional[StopReason] = None  # set on the last chunk
    n_tokens: int = 0  # tokens generated for this prompt so far


@dataclass
class _Batch:
    """The state of one call to `generate` while it decodes."""

    tokens: torch.Tensor  # (bsz, total_len), prompts right-padded with pad_id
    prompt_lens: List[int]
    token_logprobs: Optional[torch.Tensor]  # (bsz, total_len), logprob of each token given those before
    eos_reached: torch.Tensor  # (bsz,)
    cur_pos: int = 0  # positions [0, cur_pos) are final


class Llama:
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
        compile: bool = False,
    ) -> "Llama":
        """Build a Llama instance by loading a checkpoint and its tokenizer.

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

        Returns:
            Llama: the model and tokenizer, ready to generate.

        Raises:
            FileNotFoundError: when ckpt_dir, params.json/config.json, a shard or the tokenizer is missing.
            ValueError: for arguments or checkpoints that cannot work together; the message says which.
        """
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        device = resolve_device(device)
        reader = open_checkpoint(ckpt_dir)
        tokenizer_path = find_tokenizer(ckpt_dir, tokenizer_path)
        model_args, ignored = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
        context = SCALED_ROPE_CONTEXT if model_args.use_scaled_rope else LLAMA3_CONTEXT
        if max_seq_len > context:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds this checkpoint's context of {context} tokens")
        if dtype is None and reader.format == "hf":
            dtype = reader.dtype
        dtype = resolve_dtype(dtype, device)

        start_time = time.time()
        model_parallel_size = init_model_parallel(device, model_parallel_size, timeout)
        torch.manual_seed(seed)  # the same in all processes: they must sample the same tokens
        print(f"Loading a {'Meta' if reader.format == 'meta' else 'Hugging Face'} checkpoint from {ckpt_dir}")
        if ignored:
            print(f"Ignoring unknown checkpoint parameters: {ignored}")

        tokenizer = Tokenizer(str(tokenizer_path), version=version or ("3.1" if model_args.use_scaled_rope else "3"))
        if model_args.vocab_size != tokenizer.n_words:
            raise ValueError(
                f"The checkpoint's vocab_size ({model_args.vocab_size}) differs from the tokenizer's "
                f"({tokenizer.n_words} tokens in {tokenizer_path}); use the tokenizer.model that came with it"
            )
        model = load_model(
            reader, model_args, fs_init.get_model_parallel_rank(), model_parallel_size, device, dtype
        )
        print(f"Loaded in {time.time() - start_time:.2f} seconds")
        generator = Llama(model, tokenizer)
        if compile:
            generator.compile_decode_step()
        return generator

    def __init__(self, model: Transformer, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = ChatFormat(tokenizer)
        self.decode_step = None  # a compiled Transformer.decode_step, once compile_decode_step() was called

    def compile_decode_step(self) -> None:
        """Decode one token per row with `Transformer.decode_step` compiled by torch.compile, from now on.

        Its shapes stay the same at every position, so one compiled graph serves them all, whatever the prompt and
        output lengths; on CUDA it is replayed as a CUDA graph, with no per-kernel launch cost. The first call for
        each batch size compiles (tens of seconds); prompts still run through `Transformer.forward`. It is the
        same math, fused and summed in another order: float32 gives the eager path's tokens (tested), while in
        bfloat16 a near tie between two tokens can go the other way, as between any two bfloat16 kernels.
        """
        self.decode_step = compiled_decode_step(self.model)

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device

    @torch.inference_mode()
    def generate(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
    ) -> Tuple[List[List[int]], Optional[List[List[float]]]]:
        """Generate token sequences for a batch of tokenized prompts.

        Args:
            prompt_tokens: One list of token IDs per prompt.
            max_gen_len: The most tokens to generate per prompt.
            temperature: Softmax temperature; 0 means greedy decoding.
            top_p: Nucleus sampling threshold, in (0, 1].
            logprobs: Also return each output token's log-probability.
            echo: Include the prompt tokens in the output.

        Returns:
            The generated tokens per prompt, cut before the first stop token, and their logprobs if asked for.

        Raises:
            ValueError: for an empty batch or prompt, a batch or prompt that is too long, or a bad parameter.
        """
        out_tokens, out_logprobs, _ = self._run(prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo)
        return out_tokens, out_logprobs if logprobs else None

    def text_completion(
        self,
        prompts: List[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
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
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens=self._encode_prompts(prompts),
            max_gen_len=self._gen_len(max_gen_len),
            temperature=temperature,
            top_p=top_p,
            logprobs=logprobs,
            echo=echo,
        )
        if logprobs:
            return [
                {
                    "generation": self.tokenizer.decode(t),
                    "tokens": [self.tokenizer.decode([x]) for x in t],
                    "logprobs": logprobs_i,
                }
                for t, logprobs_i in zip(generation_tokens, generation_logprobs)
            ]
        return [{"generation": self.tokenizer.decode(t)} for t in generation_tokens]

    @torch.inference_mode()
    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
    ) -> List[ChatPrediction]:
        """Answer each dialog as the assistant.

        Args:
            dialogs: Conversations, each a list of {"role", "content"} messages.
            temperature: Softmax temperature; 0 means greedy decoding.
            top_p: Nucleus sampling threshold, in (0, 1].
            max_gen_len: The most tokens to generate; None means max_seq_len - 1.
            logprobs: Also return each generated token's text and log-probability.

        Returns:
            One ChatPrediction per dialog: {"generation": {"role": "assistant", "content": text},
            "stop_reason": "end_of_turn" | "end_of_message" | "length"}, plus "tokens" and "logprobs" if asked for.

        Raises:
            ValueError: for an empty list or dialog, an unknown role, too many or too long dialogs, or a bad
                parameter.
        """
        generation_tokens, generation_logprobs, stop_reasons = self._run(
            self._encode_dialogs(dialogs), self._gen_len(max_gen_len), temperature, top_p, logprobs, echo=False
        )
        results: List[ChatPrediction] = []
        for t, logprobs_i, reason in zip(generation_tokens, generation_logprobs, stop_reasons):
            result: ChatPrediction = {"generation": {"role": "assistant", "content": self.tokenizer.decode(t)}}
            if logprobs:
                result["tokens"] = [self.tokenizer.decode([x]) for x in t]
                result["logprobs"] = logprobs_i
            result["stop_reason"] = reason
            results.append(result)
        return results

    @torch.inference_mode()
    def text_completion_stream(
        self,
        prompts: List[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Like `text_completion`, but yields each prompt's new text as soon as it can be decoded.

        Chunks of different prompts interleave; join the `text` of one `index` to get its whole generation,
        which equals `text_completion`'s for the same seed. A chunk never ends inside a multi-byte character.
        Each prompt's last chunk has `finished=True` and its `stop_reason`.

        Raises:
            ValueError: as `text_completion`.
        """
        yield from self._stream(self._encode_prompts(prompts), self._gen_len(max_gen_len), temperature, top_p)

    @torch.inference_mode()
    def chat_completion_stream(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Like `chat_completion`, but yields each answer's new text as soon as it can be decoded.

        See `text_completion_stream` for the chunks; joined, they equal `chat_completion`'s content.

        Raises:
            ValueError: as `chat_completion`.
        """
        yield from self._stream(self._encode_dialogs(dialogs), self._gen_len(max_gen_len), temperature, top_p)

    def _gen_len(self, max_gen_len: Optional[int]) -> int:
        """max_gen_len, where None means as many tokens as the context allows (max_seq_len - 1)."""
        return self.model.params.max_seq_len - 1 if max_gen_len is None else max_gen_len

    def _run(self, prompt_tokens, max_gen_len, temperature, top_p, logprobs, echo):
        """Decode the whole batch; the cut outputs, their logprobs and why each stopped (see `_finish`)."""
        batch = self._start(prompt_tokens, max_gen_len, temperature, top_p, logprobs)
        for _ in self._decode(batch, temperature, top_p):
            pass
        return self._finish(batch, max_gen_len, echo)

    def _encode_prompts(self, prompts: List[str]) -> List[List[int]]:
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of strings; wrap a single prompt in a list: [prompt]")
        if not prompts:
            raise ValueError("No prompts given; pass a list with at least one prompt")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"Prompt {i} is {'empty' if prompt == '' else 'not a string'}: {prompt!r}")
        return [self.tokenizer.encode(x, bos=True, eos=False) for x in prompts]

    def _encode_dialogs(self, dialogs: List[Dialog]) -> List[List[int]]:
        if not dialogs:
            raise ValueError("No dialogs given; pass a list with at least one dialog")
        for i, dialog in enumerate(dialogs):
            if isinstance(dialog, dict):
                raise ValueError("dialogs must be a list of dialogs (lists of messages); wrap one dialog in a list")
            if not dialog:
                raise ValueError(f"Dialog {i} is empty; give it at least one message")
        return [self.formatter.encode_dialog_prompt(dialog) for dialog in dialogs]

    def _start(self, prompt_tokens, max_gen_len, temperature, top_p, logprobs) -> _Batch:
        """Check the arguments and lay out the batch."""
        params = self.model.params
        check_sampling(temperature, top_p, max_gen_len)
        if any(not isinstance(t, (list, tuple)) for t in prompt_tokens):
            raise ValueError("prompt_tokens must be a list of token-ID lists; wrap a single prompt in a list")
        bsz = len(prompt_tokens)
        if bsz == 0:
            raise ValueError("No prompts given; pass at least one")
        if bsz > params.max_batch_size:
            raise ValueError(f"{bsz} prompts exceed max_batch_size={params.max_batch_size}; raise it in Llama.build")
        for i, t in enumerate(prompt_tokens):
            if len(t) == 0:
                raise ValueError(f"Prompt {i} is empty; give every prompt at least one token")
            if len(t) > params.max_seq_len:
                raise ValueError(
                    f"Prompt {i} is {len(t)} tokens long, longer than max_seq_len={params.max_seq_len}; "
                    "shorten it or raise max_seq_len in Llama.build"
                )
            outside = [x for x in t if not (isinstance(x, int) and 0 <= x < params.vocab_size)]
            if outside:
                raise ValueError(
                    f"Prompt {i} has token IDs outside the vocabulary [0, {params.vocab_size}): {outside[:5]}"
                )
        total_len = min(params.max_seq_len, max_gen_len + max(len(t) for t in prompt_tokens))
        tokens = torch.full((bsz, total_len), self.tokenizer.pad_id, dtype=torch.long, device=self.device)
        for k, t in enumerate(prompt_tokens):
            tokens[k, : len(t)] = torch.tensor(t, dtype=torch.long, device=self.device)
        return _Batch(
            tokens=tokens,
            prompt_lens=[len(t) for t in prompt_tokens],
            token_logprobs=torch.zeros_like(tokens, dtype=torch.float) if logprobs else None,
            eos_reached=torch.zeros(bsz, dtype=torch.bool, device=self.device),
            cur_pos=min(len(t) for t in prompt_tokens),
        )

    def _decode(self, batch: _Batch, temperature: float, top_p: float) -> Iterator[_Batch]:
        """Fill the batch one position at a time, yielding it after each; stops when every row is done."""
        tokens, pad_id = batch.tokens, self.tokenizer.pad_id
        total_len = tokens.shape[1]
        input_text_mask = tokens != pad_id
        stop_tokens = torch.tensor(sorted(self.tokenizer.stop_tokens), dtype=torch.long, device=self.device)
        want_logprobs = batch.token_logprobs is not None
        if batch.cur_pos == total_len and want_logprobs:
            # The prompts fill the whole window: score them, token t against the logits of t - 1.
            # (The reference scores token t against its own position here; that is its one bug we fix.)
            logits = self.model.forward(tokens, 0)
            batch.token_logprobs[:, 1:] = -F.cross_entropy(
                input=logits[:, :-1].transpose(1, 2), target=tokens[:, 1:], reduction="none", ignore_index=pad_id
            )
        prev_pos = 0
        for cur_pos in range(batch.cur_pos, total_len):
            if self.decode_step is not None and cur_pos - prev_pos == 1:
                position = torch.tensor([prev_pos], device=self.device)
                logits = self.decode_step(tokens[:, prev_pos:cur_pos], position)
            else:
                logits = self.model.forward(tokens[:, prev_pos:cur_pos], prev_pos, last_logits_only=not want_logprobs)
            if temperature > 0:
                probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
                next_token = sample_top_p(probs, top_p)
            else:
                next_token = torch.argmax(logits[:, -1], dim=-1)
            next_token = next_token.reshape(-1)
            # only replace token if prompt has already been generated
            next_token = torch.where(input_text_mask[:, cur_pos], tokens[:, cur_pos], next_token)
            tokens[:, cur_pos] = next_token
            if want_logprobs:
                batch.token_logprobs[:, prev_pos + 1 : cur_pos + 1] = -F.cross_entropy(
                    input=logits.transpose(1, 2),
                    target=tokens[:, prev_pos + 1 : cur_pos + 1],
                    reduction="none",
                    ignore_index=pad_id,
                )
            batch.eos_reached |= (~input_text_mask[:, cur_pos]) & torch.isin(next_token, stop_tokens)
            batch.cur_pos = cur_pos + 1
            prev_pos = cur_pos
            yield batch
            if batch.eos_reached.all():
                break

    def _finish(
        self, batch: _Batch, max_gen_len: int, echo: bool
    ) -> Tuple[List[List[int]], List[Optional[List[float]]], List[StopReason]]:
        """Cut each row to its output: from 0 (echo) or the prompt end, up to max_gen_len, before a stop token."""
        token_logprobs = batch.token_logprobs.tolist() if batch.token_logprobs is not None else None
        out_tokens, out_logprobs, stop_reasons = [], [], []
        for i, toks in enumerate(batch.tokens.tolist()):
            prompt_len = batch.prompt_lens[i]
            start = 0 if echo else prompt_len
            toks = toks[start : prompt_len + max_gen_len]
            probs = token_logprobs[i][start : prompt_len + max_gen_len] if token_logprobs else None
            cut, reason = self._cut_at_stop(toks)
            out_tokens.append(cut)
            out_logprobs.append(probs[: len(cut)] if probs is not None else None)
            stop_reasons.append(reason or "length")
        return out_tokens, out_logprobs, stop_reasons

    def _cut_at_stop(self, tokens: List[int]) -> Tuple[List[int], Optional[StopReason]]:
        """`tokens` up to the first stop token, and which kind of stop it was (None: no stop token)."""
        stop_at = [tokens.index(stop) for stop in self.tokenizer.stop_tokens if stop in tokens]
        if not stop_at:
            return tokens, None
        first = min(stop_at)
        return tokens[:first], "end_of_message" if tokens[first] == self.tokenizer.eom_id else "end_of_turn"

    def _stream(self, prompt_tokens, max_gen_len, temperature, top_p) -> Iterator[StreamChunk]:
        batch = self._start(prompt_tokens, max_gen_len, temperature, top_p, logprobs=False)
        # Tokens can end inside a UTF-8 character; the incremental decoder holds such bytes back.
        decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in prompt_tokens]
        sent = [0] * len(prompt_tokens)  # generated tokens already decoded, per row
        finished = [False] * len(prompt_tokens)
        for batch in itertools.chain([batch], self._decode(batch, temperature, top_p)):
            for i, prompt_len in enumerate(batch.prompt_lens):
                end = min(batch.cur_pos, prompt_len + max_gen_len)
                if finished[i] or end <= prompt_len:
                    continue
                new_tokens, reason = self._cut_at_stop(batch.tokens[i, prompt_len + sent[i] : end].tolist())
                if reason is None and end == min(batch.tokens.shape[1], prompt_len + max_gen_len):
                    reason = "length"
                sent[i] += len(new_tokens)
                finished[i] = reason is not None
                text = decoders[i].decode(self.tokenizer.decode_bytes(new_tokens), final=finished[i])
                if text or finished[i]:
                    yield StreamChunk(i, text, finished[i], reason, n_tokens=sent[i])
        for i in range(len(prompt_tokens)):  # rows that had no room to generate anything
            if not finished[i]:
                text = decoders[i].decode(b"", final=True)
                yield StreamChunk(index=i, text=text, finished=True, stop_reason="length", n_tokens=sent[i])


def compiled_decode_step(model: Transformer):
    """`model.decode_step` compiled by torch.compile, replayed as a CUDA graph on CUDA.

    fairscale's layers left in `model` (as after `llama.parallel_layers.unpack_layers`) are replaced with
    `llama.parallel_layers`' (the same weights and math) first: with theirs, the step would not compile to one
    graph.
    """
    use_parallel_layers(model)
    options = {
        "triton.cudagraphs": model.tok_embeddings.weight.is_cuda,  # what mode="reduce-overhead" turns on
        "emulate_precision_casts": True,  # round bf16/fp16 intermediates where the eager path does
    }
    # Compiled without the inference mode that decode_step enters, which torch.compile cannot trace in a graph
    # of inference tensors with views (pytorch/pytorch#180823), and run inside it.
    step = torch.compile(functools.partial(Transformer.decode_step.__wrapped__, model), dynamic=False, options=options)

    def decode_step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            # A column of the batch's token table has its row stride, which changes with the table's length and
            # would compile the step again for each (contiguous() keeps it for one row); a copy's strides do not.
            return step(tokens.clone(memory_format=torch.contiguous_format), position)

    return decode_step


def check_sampling(temperature: float, top_p: float, max_gen_len: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not isinstance(max_gen_len, int) or max_gen_len < 0:
        raise ValueError(f"max_gen_len must be a non-negative integer, got {max_gen_len!r}")


def sample_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling: draw from the smallest set of tokens whose probabilities add up to more than `p`.

    Args:
        probs: Probability distributions, (bsz, vocab_size).
        p: Probability mass to keep.

    Returns:
        The sampled token indices, (bsz, 1).
    """
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    mask = probs_sum - probs_sort > p
    probs_sort[mask] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    next_token = torch.multinomial(probs_sort, num_samples=1)
    next_token = torch.gather(probs_idx, -1, next_token)
    return next_token


def find_tokenizer(ckpt_dir: str, tokenizer_path: Optional[str]) -> Path:
    """The tokenizer file: `tokenizer_path`, else tokenizer.model in ckpt_dir or ckpt_dir/original."""
    if tokenizer_path is not None:
        if not Path(tokenizer_path).is_file():
            raise FileNotFoundError(f"Tokenizer file {tokenizer_path} not found; pass the path to tokenizer.model")
        return Path(tokenizer_path)
    candidates = [Path(ckpt_dir) / "tokenizer.model", Path(ckpt_dir) / "original" / "tokenizer.model"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"No tokenizer.model found (looked in {', '.join(str(c) for c in candidates)}); pass tokenizer_path"
    )
