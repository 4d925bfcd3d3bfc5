"""An OpenAI-compatible HTTP server with continuous batching (docs/serve.md).

    python -m llama.serve --ckpt_dir DIR [--port 8000] [--max_batch_size 8] [--max_seq_len 2048] ...
    torchrun --nproc_per_node N -m llama.serve --ckpt_dir DIR ...

Under torchrun the process of rank 0 serves HTTP and plans each step; every process runs the model.
"""

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional

from llama.arguments import LOOKUP
from llama.cli.common import add_compile_flags, add_draft_flags, build_from_flags, user_errors

INSTALL = "pip install 'llama3[serve]' (from a checkout: pip install -e '.[serve]')"


def parse_args(argv: Optional[List[str]], prog: Optional[str] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m llama.serve",
        description="Serve a checkpoint over OpenAI's HTTP API, with continuous batching.",
    )
    parser.add_argument(
        "checkpoint", nargs="?", help="Meta or Hugging Face folder, GGUF file or ollama:NAME (or --ckpt_dir)"
    )
    parser.add_argument("--ckpt_dir", help="the checkpoint folder, as the example scripts name it")
    parser.add_argument("--tokenizer_path", help="tokenizer.model (default: looked for in ckpt_dir)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max_batch_size", type=int, default=8, help="requests decoded together (rows)")
    parser.add_argument("--max_seq_len", type=int, default=2048, help="most prompt plus answer tokens of a request")
    parser.add_argument("--max_queue", type=int, default=64, help="requests that may wait for a row; then HTTP 429")
    parser.add_argument("--prefill_chunk", type=int, default=512, help="most prompt tokens run in one step")
    parser.add_argument("--quantize", choices=["int8", "int4"], help="quantize the weights as they load")
    add_compile_flags(parser)
    parser.add_argument(
        "--noprefix_cache",
        dest="prefix_cache",
        action="store_false",
        help="prefill every prompt in full, as Meta's code does (default: reuse the start of a prompt that a cache row "
        "already holds: in float32 the same greedy tokens; in bfloat16 a near-tie may break otherwise, and a seeded "
        "sample can differ from a cold run's)",
    )
    add_draft_flags(parser)
    parser.add_argument("--device", help='"cuda", "cpu", ... (default: CUDA when available)')
    parser.add_argument("--dtype", help='"bfloat16", "float16" or "float32" (default: per device)')
    parser.add_argument(
        "--api_key",
        default=os.environ.get("LLAMA_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $LLAMA_API_KEY; none: no check)",
    )
    parser.add_argument("--model_name", help="the model's name in the API (default: ckpt_dir's folder name)")
    parser.add_argument("--drain_timeout", type=float, default=10, help="seconds to finish requests on Ctrl-C/SIGTERM")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (args.ckpt_dir is None):
        parser.error("give the checkpoint folder once: as the first argument or as --ckpt_dir")
    args.ckpt_dir = args.ckpt_dir or args.checkpoint
    del args.checkpoint
    for name in ("max_batch_size", "max_seq_len", "prefill_chunk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.draft not in (None, LOOKUP):
        parser.error(f"under torchrun the server speculates by prompt lookup only: --draft {LOOKUP}, or no --draft")
    if args.max_queue < 0 or not 0 <= args.port < 65536:
        parser.error("--max_queue must be >= 0 and --port in 0..65535")
    return args


def missing_dependencies() -> List[str]:
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> None:
    """Load the checkpoint and serve it until Ctrl-C or SIGTERM (`llama serve` runs this too)."""
    args = parse_args(argv, prog)
    missing = missing_dependencies()
    if missing:
        print(f"error: llama.serve needs {' and '.join(missing)}: {INSTALL}", file=sys.stderr)
        raise SystemExit(2)
    import torch.distributed as dist
    import uvicorn

    from llama.distributed import several_processes
    from llama.runtime.compiled import is_compiled
    from llama.serve.app import Service, create_app
    from llama.serve.engine import Engine
    from llama.serve.engine_plan import PlanChannel, follow_plans

    with user_errors(vars(args)):
        generator = build_from_flags(args)
    channel = PlanChannel() if several_processes() else None
    decode_step = generator.decode_step  # compiled, or CUDA graphs; None: the eager step
    model = generator.decoder.model  # the text runtime (of a vision model: its text model, which encodes images)
    if channel is not None and dist.get_rank() > 0:
        follow_plans(model, decode_step, channel)
        return
    engine = Engine(
        model,
        generator.tokenizer,
        decode_step,
        args.max_queue,
        args.prefill_chunk,
        fixed_batch=is_compiled(decode_step),
        channel=channel,
        prefix_cache=args.prefix_cache,
        draft=generator.decoder.draft,
        draft_max=generator.decoder.draft_max,
    )
    name = args.model_name or Path(args.ckpt_dir).resolve().name
    app = create_app(Service(engine, generator.tokenizer, name), args.api_key)
    print(f"Serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, timeout_graceful_shutdown=args.drain_timeout, log_level="warning"
    )
    try:
        uvicorn.Server(config).run()  # drains on Ctrl-C or SIGTERM, then raises the signal again, as uvicorn does
    except KeyboardInterrupt:
        raise SystemExit(128 + signal.SIGINT) from None
