import sys
from typing import List

from llama import Llama
from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, check_sampling
from llama.cli import common


def main(
    ckpt_dir: str,
    tokenizer_path: str = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
    device: str = None,
    dtype: str = None,
    compile: bool = None,
    cuda_graphs: bool = True,
    quantize: str = None,
):
    """Continues four prompts with a pretrained (not chat-tuned) Llama and prints each with its continuation.

    A base model just carries on the text it is given, so every prompt below is the opening of a text for it
    to finish. It seldom decides on its own that a text is over, which is why generation is capped by
    `max_gen_len`. Run it with python, or with torchrun and one process per model-parallel shard of the
    checkpoint, e.g. `torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir Meta-Llama-3-8B/`.

    Args:
        ckpt_dir: Checkpoint folder, Meta's layout (params.json, consolidated.NN.pth) or Hugging Face's
            (config.json, model*.safetensors).
        tokenizer_path: The tokenizer.model file; by default it is looked for in ckpt_dir and ckpt_dir/original.
        temperature: Sampling temperature: lower is more predictable, 0 always takes the most likely token.
        top_p: Nucleus sampling: each token is drawn from the fewest most likely tokens whose probabilities
            add up to top_p.
        max_seq_len: Tokens of prompt plus continuation that the KV cache holds; at most the model's context
            length, 8192 for Llama 3 and 131072 for Llama 3.1 and later.
        max_gen_len: Most new tokens per prompt.
        max_batch_size: Most prompts run together; the four prompts here need at least 4.
        device: "cuda", "cuda:N", "cpu" or "mps"; by default CUDA if there is a GPU, else the CPU.
        dtype: "bfloat16", "float16" or "float32"; by default bfloat16 on CUDA and float32 on the CPU.
        compile: Decode with torch.compile (plus CUDA graphs on CUDA); the first steps are slow while it
            compiles, so it pays off on CUDA for longer runs. By default only quantized weights on one CUDA GPU
            compile; --nocompile never does.
        cuda_graphs: On one GPU, replay each decode step as a CUDA graph, one launch instead of hundreds (the default;
            the eager step's logits); --nocuda_graphs decodes eagerly.
        quantize: "int8" or "int4": keep the linear layers' weights in 8 or 4 bits, quantized as they load;
            about 2x or 4x less memory than bfloat16 and faster decoding. On the CPU, dtype then defaults to bfloat16.
    """
    prompts: List[str] = [
        # Plain openings: the model should simply carry on writing.
        "The best thing about walking home in the rain is",
        "In a nutshell, a rainbow forms because sunlight ",
        "A short note thanking a neighbour for watering the plants:\n\nDear Mrs. Alvarez,\n\nThank you so much for ",
        # Few-shot: three worked pairs set the pattern, the fourth is left for the model to fill in.
        "English words and their German equivalents:\n\n"
        "lighthouse => Leuchtturm\n"
        "strawberry jam => Erdbeermarmelade\n"
        "snowy owl => Schneeeule\n"
        "bread =>",
    ]
    check_sampling(temperature, top_p, max_gen_len)  # before the minutes a load can take
    common.check_prompts_fit(ckpt_dir, tokenizer_path, prompts, max_seq_len, max_batch_size)
    # Every rank computes the same completions; only the first one prints them.
    sys.stdout = common.rank0_stream(sys.stdout)

    generator = Llama.build(
        ckpt_dir=ckpt_dir,
        tokenizer_path=tokenizer_path,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        device=device,
        dtype=dtype,
        compile=compile,
        cuda_graphs=cuda_graphs,
        quantize=quantize,
    )
    print(generator.load_report)
    results = generator.text_completion(
        prompts,
        max_gen_len=max_gen_len,
        temperature=temperature,
        top_p=top_p,
    )
    for prompt, result in zip(prompts, results):
        print(prompt)
        print(f"> {result['generation']}")
        print("\n==================================\n")
    print(generator.last_speed)


if __name__ == "__main__":
    common.run(main)
