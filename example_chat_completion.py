import sys
from typing import List

from llama import Dialog, Llama
from llama.arguments import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, check_sampling
from llama.cli import common
from llama.cli.chat import run_chat


def main(
    ckpt_dir: str,
    tokenizer_path: str = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_seq_len: int = 512,
    max_batch_size: int = 4,
    max_gen_len: int = None,
    device: str = None,
    dtype: str = None,
    compile: bool = None,
    cuda_graphs: bool = True,
    quantize: str = None,
    interactive: bool = False,
    system_prompt: str = None,
):
    """Answers four sample dialogs with a chat-tuned (Instruct) Llama, or chats in the terminal.

    Each dialog is a list of messages that ends with the user's turn; it may start with a system message
    that sets how the assistant should reply. Chat models end their reply themselves with `<|eot_id|>`, so
    `max_gen_len` can be left unset. Run it with python, or with torchrun and one process per
    model-parallel shard of the checkpoint, e.g.
    `torchrun --nproc_per_node 1 example_chat_completion.py --ckpt_dir Meta-Llama-3-8B-Instruct/`.

    Args:
        ckpt_dir: Checkpoint folder, Meta's layout (params.json, consolidated.NN.pth) or Hugging Face's
            (config.json, model*.safetensors).
        tokenizer_path: The tokenizer.model file; by default it is looked for in ckpt_dir and ckpt_dir/original.
        temperature: Sampling temperature: lower is more predictable, 0 always takes the most likely token.
        top_p: Nucleus sampling: each token is drawn from the fewest most likely tokens whose probabilities
            add up to top_p.
        max_seq_len: Tokens of dialog plus reply that the KV cache holds; at most the model's context
            length, 8192 for Llama 3 and 131072 for Llama 3.1 and later.
        max_batch_size: Most dialogs run together; the four sample dialogs need at least 4.
        max_gen_len: Most tokens per reply; by default a reply may fill what is left of max_seq_len.
        device: "cuda", "cuda:N", "cpu" or "mps"; by default CUDA if there is a GPU, else the CPU.
        dtype: "bfloat16", "float16" or "float32"; by default bfloat16 on CUDA and float32 on the CPU.
        compile: Decode with torch.compile (plus CUDA graphs on CUDA); the first steps are slow while it
            compiles, so it pays off on CUDA for longer runs. By default only quantized weights on one CUDA GPU
            compile; --nocompile never does.
        cuda_graphs: On one GPU, replay each decode step as a CUDA graph, one launch instead of hundreds (the default;
            the eager step's logits); --nocuda_graphs decodes eagerly.
        interactive: Skip the sample dialogs and chat with the model in the terminal.
        system_prompt: With --interactive, a system message that opens the conversation.
        quantize: "int8" or "int4": keep the linear layers' weights in 8 or 4 bits, quantized as they load;
            about 2x or 4x less memory than bfloat16 and faster decoding. On the CPU, dtype then defaults to bfloat16.
    """
    dialogs: List[Dialog] = [
        [{"role": "user", "content": "How do I keep a bunch of fresh basil from wilting?"}],
        [
            {"role": "user", "content": "I just bought my first guitar. What should I practise first?"},
            {
                "role": "assistant",
                "content": (
                    "Congratulations on the new guitar! Start every session by tuning it, so that your ear "
                    "learns what in tune sounds like. Then learn a handful of open chords (E minor, A minor, C, "
                    "G and D cover a great many songs) and move between two of them slowly until each change "
                    "is clean. Finally, strum along with a metronome at a slow tempo, and speed up only once "
                    "every change lands on the beat. Fifteen minutes a day does more than one long session a week."
                ),
            },
            {"role": "user", "content": "Why does practising with a metronome matter so much?"},
        ],
        [
            {"role": "system", "content": "Reply only in limericks."},
            {"role": "user", "content": "What should I pack for a weekend of camping in the mountains?"},
        ],
        [
            {"role": "system", "content": "Answer the way a ship's captain from an old sea story would talk."},
            {"role": "user", "content": "Why does the Moon change shape over a month?"},
        ],
    ]
    check_sampling(temperature, top_p, max_gen_len)  # before the minutes a load can take
    if system_prompt is not None and not interactive:
        raise ValueError("system_prompt is for the terminal chat only; add interactive, or leave it out")
    if not interactive:
        common.check_prompts_fit(ckpt_dir, tokenizer_path, dialogs, max_seq_len, max_batch_size)
    # Every rank computes the same replies; only the first one prints them.
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
        prefix_cache=interactive,  # the terminal chat reuses its dialog's cache, as `llama chat` does
    )
    print(generator.load_report)
    if interactive:
        run_chat(generator, system_prompt, temperature, top_p, max_gen_len)
        return
    results = generator.chat_completion(
        dialogs,
        max_gen_len=max_gen_len,
        temperature=temperature,
        top_p=top_p,
    )

    for dialog, result in zip(dialogs, results):
        for msg in dialog:
            print(f"{msg['role'].capitalize()}: {msg['content']}\n")
        print(f"> {result['generation']['role'].capitalize()}: {result['generation']['content']}")
        print("\n==================================\n")
    print(generator.last_speed)


if __name__ == "__main__":
    common.run(main)
