"""One process of a model-parallel Llama 3.2 Vision run, launched by tests/test_vision.py under torchrun:

    torchrun --nproc_per_node 2 tests/vision_worker.py CKPT_DIR TOKENIZER OUT_PREFIX

Every rank answers DIALOGS greedily, with logprobs, and writes OUT_PREFIX.rank{R}.json."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import png_bytes  # noqa: E402

from llama import Llama  # noqa: E402


def image(width: int, height: int, seed: int) -> dict:
    return {"type": "image", "image": png_bytes(width, height, seed=seed)}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


DIALOGS = [
    [{"role": "user", "content": [image(90, 60, seed=1), text("What?")]}],
    [{"role": "user", "content": [text("Two:"), image(20, 50, seed=2), image(30, 30, seed=3)]}],
]


def main() -> None:
    ckpt_dir, tokenizer_path, out_prefix = sys.argv[1:4]
    llama = Llama.build(ckpt_dir, tokenizer_path, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32")
    answers = [llama.chat_completion([dialog], temperature=0, max_gen_len=6, logprobs=True)[0] for dialog in DIALOGS]
    rank = int(os.environ.get("RANK", 0))
    Path(f"{out_prefix}.rank{rank}.json").write_text(json.dumps(answers))


if __name__ == "__main__":
    main()
