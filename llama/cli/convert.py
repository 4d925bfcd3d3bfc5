"""Convert checkpoints between Meta's layout, Hugging Face's and GGUF files, or quantize one.

    llama convert to-hf    META_DIR|FILE.gguf OUT_DIR [--max_shard_gb 5]
    llama convert to-meta  HF_DIR|FILE.gguf   OUT_DIR [--model_parallel_size N]
    llama convert to-gguf  META_DIR|HF_DIR    OUT.gguf [--type F32|F16|BF16]
    llama convert quantize CKPT_DIR OUT_DIR --scheme int8|int4 [--group_size 32] [--model_parallel_size N]

(`python -m llama.convert ...` is the same.) A Llama 3.2 Vision checkpoint converts both ways too: to-hf writes a
transformers MllamaForConditionalGeneration folder, and to-meta reads one (docs/vision.md).
Tensors are streamed: at most one output file's worth of weights is in memory at a time (for `quantize`, the
quantized weights and one layer in floating point). The output is written to a temporary folder and renamed
when complete, so an interrupted run never looks finished.
"""

import argparse
import time
from pathlib import Path
from typing import List, Optional

from llama.checkpoint.convert import hf_to_meta, meta_to_hf, quantize_checkpoint, to_gguf
from llama.cli.common import ends_on_ctrl_c, user_errors
from llama.quantize import DEFAULT_GROUP_SIZE


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("to-hf", help="Meta checkpoint or GGUF file -> Hugging Face folder")
    to_hf.add_argument("src", type=Path)
    to_hf.add_argument("out_dir", type=Path)
    to_hf.add_argument("--max_shard_gb", type=float, default=5.0, help="largest .safetensors file, in GiB")
    to_meta = sub.add_parser("to-meta", help="Hugging Face folder or GGUF file -> Meta checkpoint")
    to_meta.add_argument("src", type=Path)
    to_meta.add_argument("out_dir", type=Path)
    to_meta.add_argument("--model_parallel_size", type=int, default=1, help="consolidated.NN.pth shards to write")
    to_gguf_parser = sub.add_parser("to-gguf", help="Meta or Hugging Face checkpoint -> GGUF file (llama.cpp, ollama)")
    to_gguf_parser.add_argument("src", type=Path)
    to_gguf_parser.add_argument("out_dir", type=Path, metavar="out")
    to_gguf_parser.add_argument("--type", default="BF16", help="the matrices' type: F32, F16 or BF16 (default)")
    quantize = sub.add_parser("quantize", help="Meta or Hugging Face checkpoint -> quantized Meta checkpoint")
    quantize.add_argument("src", type=Path)
    quantize.add_argument("out_dir", type=Path)
    quantize.add_argument("--scheme", required=True, help="int8 or int4 (see docs/quantize.md)")
    quantize.add_argument("--group_size", type=int, help=f"int4's group size: 256, 128, 64 or {DEFAULT_GROUP_SIZE}")
    quantize.add_argument("--model_parallel_size", type=int, default=1, help="consolidated.NN.pth shards to write")
    args = parser.parse_args(argv)
    start = time.time()
    with ends_on_ctrl_c(), user_errors(["max_shard_gb", "model_parallel_size", "group_size", "type"]):
        if args.direction == "to-hf":
            meta_to_hf(args.src, args.out_dir, int(args.max_shard_gb * 2**30))
        elif args.direction == "to-meta":
            hf_to_meta(args.src, args.out_dir, args.model_parallel_size)
        elif args.direction == "to-gguf":
            to_gguf(args.src, args.out_dir, args.type)
        else:
            quantize_checkpoint(args.src, args.out_dir, args.scheme, args.group_size, args.model_parallel_size)
    print(f"Converted {args.src} to {args.out_dir} in {time.time() - start:.1f} seconds")
