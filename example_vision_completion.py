import sys
from pathlib import Path

from llama import Llama
from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, check_sampling
from llama.cli import common
from llama.vision.images import open_image


def main(
    ckpt_dir: str,
    image_path: str,
    tokenizer_path: str = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    device: str = None,
    dtype: str = None,
):
    """Completes two prompts with Llama 3.2 Vision, as Meta's multimodal text-completion example does: one of text
    only, and one that shows an image first and asks for a haiku about it.

    A prompt with an image is a list of parts, the image first, as the model's own prompts put it. Run it with python,
    or with torchrun and one process per model-parallel shard of the checkpoint, e.g.
    `torchrun --nproc_per_node 1 example_vision_completion.py --ckpt_dir Llama3.2-11B-Vision/ --image_path dog.jpg`
    (90B ships as 8 shards; any model-parallel size of 1, 2, 4 or 8 works). Chats with images: docs/vision.md.

    Args:
        ckpt_dir: Checkpoint folder of a Llama 3.2 Vision model, Meta's layout (params.json, consolidated.NN.pth).
        image_path: The image to show: a JPEG, PNG, GIF, WebP... file.
        tokenizer_path: The tokenizer.model file; by default it is looked for in ckpt_dir and ckpt_dir/original.
        temperature: Sampling temperature: lower is more predictable, 0 always takes the most likely token.
        top_p: Nucleus sampling: each token is drawn from the fewest most likely tokens whose probabilities
            add up to top_p.
        max_seq_len: Tokens of prompt plus continuation that the KV cache holds (an image takes one).
        max_gen_len: Most new tokens per prompt.
        device: "cuda", "cuda:N", "cpu" or "mps"; by default CUDA if there is a GPU, else the CPU.
        dtype: "bfloat16", "float16" or "float32"; by default bfloat16 on CUDA and float32 on the CPU.
    """
    check_sampling(temperature, top_p, max_gen_len)  # before the minutes a load can take
    image = open_image(image_path)  # a bad image is named now, not after the load
    prompts = [
        "The color of the sky is blue but sometimes it can also be",
        [{"type": "image", "image": image}, {"type": "text", "text": "If I had to write a haiku for this one"}],
    ]
    sys.stdout = common.rank0_stream(sys.stdout)  # every rank computes the same completions; the first prints them

    generator = Llama.build(
        ckpt_dir=ckpt_dir,
        tokenizer_path=tokenizer_path,
        max_seq_len=max_seq_len,
        max_batch_size=len(prompts),
        device=device,
        dtype=dtype,
    )
    print(generator.load_report)
    results = generator.text_completion(prompts, temperature=temperature, top_p=top_p, max_gen_len=max_gen_len)
    for prompt, result in zip(prompts, results):
        shown = prompt if isinstance(prompt, str) else f"<{Path(image_path).name}> {prompt[1]['text']}"
        print(shown)
        print(f"> {result['generation']}")
        print("\n==================================\n")
    print(generator.last_speed)


if __name__ == "__main__":
    common.run(main)
