"""Weight products on a CUDA GPU, one kernel at a time: every way this library could run a Llama 3 8B weight's
product, bfloat16 and quantized, at the row counts of a decode step, a batch and a prompt.

    python benchmarks/cuda_kernels.py                       # 8B's weight shapes, rows 1, 8 and 512
    python benchmarks/cuda_kernels.py --rows 1 --shapes w13 # one shape, one row count

Each product is timed with CUDA events over copies of its weight that together outgrow the L2 cache (so a
weight is read from memory, as in a decode step through 32 layers): the median of 5 rounds of 20 calls. The
bandwidth column counts the bytes the product must read (weights, scales, activations), over its time. Candidates:
- bf16: `F.linear` on the bfloat16 weight (the unquantized baseline); for qkv and w13 also as separate products;
- int8 `_weight_int8pack_mm`, int8 widened in eager (`F.linear(x, w.to(bf16)) * s`), int8 widened inside a
  compiled product (torch.compile with coordinate-descent tuning), GemLite's A16W8;
- int4 `_weight_int4pack_mm` (tinygemm), int4 dequantized inside a compiled product, int4 dequantized into a
  bfloat16 weight then `F.linear` (for prompts), GemLite's A16W4.
A candidate that fails prints why and is left out.
"""

import argparse
import statistics
import traceback

import torch
import torch.nn.functional as F

SHAPES = {  # (out, in) of Llama 3 8B's weights, QKV and w1/w3 fused
    "qkv": (6144, 4096),
    "wo": (4096, 4096),
    "w13": (28672, 4096),
    "w2": (4096, 14336),
    "output": (128256, 4096),
}
L2_MULTIPLE = 4  # weight copies span at least this many L2 caches


def event_median(fn, copies: int, rounds: int = 5, calls: int = 20) -> float:
    """Median seconds per call of `fn(i)` for i cycling over `copies` weight copies."""
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i % copies)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return statistics.median(times)


def int4_parts(w: torch.Tensor, group: int):
    from llama.quantize import quantize_int4

    return quantize_int4(w, group, torch.bfloat16)


def compiled(fn):
    return torch.compile(fn, dynamic=False, options={"coordinate_descent_tuning": True})


def widen_int8(x, q, s):
    return F.linear(x, q.to(x.dtype)) * s


def int4_weight(nibbles, scales, zeros):
    n, half = nibbles.shape
    groups = scales.shape[1]
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(n, groups, -1)
    w = (q.to(torch.bfloat16) - 8) * scales[..., None] + zeros[..., None]
    return w.view(n, half * 2)


def int4_fused(x, nibbles, scales, zeros):
    return F.linear(x, int4_weight(nibbles, scales, zeros))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 512])
    parser.add_argument("--group_size", type=int, default=32)
    opts = parser.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name}, torch {torch.__version__}, L2 {props.L2_cache_size >> 20} MiB", flush=True)
    big = torch.empty(2**30, dtype=torch.uint8, device=device)
    copy_s = event_median(lambda i: big.clone(), 1)
    print(f"device copy: {2 * big.numel() / copy_s / 1e12:.2f} TB/s (read + write)", flush=True)
    try:
        from gemlite.helper import A16W8, A16Wn

        gemlite_ok = True
    except Exception as error:  # noqa: BLE001 - a probe: report and go on
        print(f"gemlite: not importable ({error!r})")
        gemlite_ok = False
    torch._dynamo.config.cache_size_limit = 64  # a graph per shape and row count
    fused_int8 = compiled(widen_int8)
    fused_int4 = compiled(int4_fused)
    dequant_int4 = compiled(int4_weight)
    decode_only = ("int8 compiled", "int4 compiled")  # compiled per row count: only the decode rows
    rows_out = []
    for name in opts.shapes:
        out, inp = SHAPES[name]
        copies = max(1, -(-L2_MULTIPLE * props.L2_cache_size // (out * inp * 2)))
        copies = min(copies, 8)
        ws = [torch.randn(out, inp, device=device, dtype=torch.bfloat16) / inp**0.5 for _ in range(copies)]
        from llama.quantize import quantize_int8

        i8 = [quantize_int8(w, torch.bfloat16) for w in ws]
        i4 = [int4_parts(w, opts.group_size) for w in ws]
        tiny = [
            (
                torch.ops.aten._convert_weight_to_int4pack(n << 4 | n >> 4, 8),
                torch.stack([s.t(), z.t()], dim=-1).contiguous(),
            )
            for n, s, z in i4
        ]
        candidates = {}
        candidates["bf16"] = (lambda x, i: F.linear(x, ws[i]), 2)
        if name in ("qkv", "w13"):
            parts = [ws[i].split([4096, 1024, 1024] if name == "qkv" else [14336, 14336]) for i in range(copies)]
            candidates["bf16 split"] = (lambda x, i: [F.linear(x, p) for p in parts[i]], 2)
        candidates["int8 pack_mm"] = (lambda x, i: torch.ops.aten._weight_int8pack_mm(x, i8[i][0], i8[i][1]), 1)
        candidates["int8 widened"] = (lambda x, i: widen_int8(x, *i8[i]), 1)
        candidates["int8 compiled"] = (lambda x, i: fused_int8(x, *i8[i]), 1)
        candidates["int4 tinygemm"] = (
            lambda x, i: torch.ops.aten._weight_int4pack_mm(x, tiny[i][0], opts.group_size, tiny[i][1]),
            0.5,
        )
        candidates["int4 compiled"] = (lambda x, i: fused_int4(x, *i4[i]), 0.5)
        candidates["int4 dequant+mm"] = (lambda x, i: F.linear(x, dequant_int4(*i4[i])), 0.5)
        if gemlite_ok:
            try:
                a16w8 = A16W8(device="cuda", dtype=torch.bfloat16)
                g8 = [a16w8.from_weights(q, scales=s[:, None].float()) for q, s in i8]
                candidates["int8 gemlite"] = (lambda x, i: g8[i](x), 1)
                g4 = []
                for n, s, z in i4:
                    from llama.quantize import unpack_nibbles

                    q = unpack_nibbles(n)
                    hqq_zero = 8 - z.float() / s.float()  # w = (q - z) * s
                    g4.append(
                        A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(
                            q, s.reshape(-1, 1), hqq_zero.to(torch.bfloat16).reshape(-1, 1), 4, opts.group_size
                        )
                    )
                candidates["int4 gemlite"] = (lambda x, i: g4[i](x), 0.5)
            except Exception:  # noqa: BLE001
                print(f"gemlite on {name}: failed\n{traceback.format_exc(limit=3)}")
        for rows in opts.rows:
            x = torch.randn(rows, inp, device=device, dtype=torch.bfloat16)
            reference = F.linear(x.float(), ws[0].float())
            for label, (fn, bytes_per_weight) in candidates.items():
                if label in decode_only and rows > 8 or label == "int4 dequant+mm" and rows < 64:
                    continue
                try:
                    y = fn(x, 0)
                    y = torch.cat(y, -1) if isinstance(y, list) else y
                    error = ((y.float() - reference).norm() / reference.norm()).item()
                    seconds = event_median(lambda i: fn(x, i), copies)
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} rows {rows} {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                moved = out * inp * bytes_per_weight + rows * (inp + out) * 2
                rows_out.append((name, rows, label, seconds * 1e6, moved / seconds / 1e12, error))
                rate = moved / seconds / 1e12
                print(
                    f"{name:6} rows {rows:4} {label:16} {seconds * 1e6:9.1f} us {rate:6.2f} TB/s {error:.2e}",
                    flush=True,
                )
    print("\nshape  rows candidate           us     TB/s  rel.err")
    for name, rows, label, us, tbs, error in rows_out:
        print(f"{name:6} {rows:4} {label:16} {us:9.1f} {tbs:6.2f} {error:.1e}")


if __name__ == "__main__":
    main()
