import ast
import operator
import sys
from datetime import datetime, timedelta, timezone

from llama import ChatFormat, Llama
from llama.arguments import DEFAULT_TOP_P, check_sampling
from llama.cli import common
from llama.tools import TOOL_PROMPT_FORMATS, Tool, chat_with_tools, tool_messages

# The calculator's operators. The expression is parsed, never evaluated by Python: only numbers and these operators
# are read, so a model cannot run code through it.
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses."""
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")

    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponents above 100 are not supported")
            result = OPERATORS[type(node.op)](left, right)
            if isinstance(result, complex) or abs(result) > 1e100:
                raise ValueError("the result is not a real number below 1e100")
            return result
        raise ValueError(f"only numbers and + - * / // % ** are supported, not {ast.unparse(node)!r}")

    return str(value(ast.parse(expression.strip(), mode="eval").body))


def clock(utc_offset: float = 0) -> str:
    """The current date and time at `utc_offset` hours from UTC."""
    if not -14 <= utc_offset <= 14:
        raise ValueError("utc_offset must be between -14 and 14 hours")
    return datetime.now(timezone(timedelta(hours=utc_offset))).strftime("%Y-%m-%d %H:%M:%S UTC%z")


TOOLS = [
    Tool(
        name="calculator",
        description="Evaluate an arithmetic expression",
        function=calculate,
        parameters={
            "expression": {"param_type": "str", "description": "Numbers with + - * / // % ** and parentheses"},
        },
    ),
    Tool(
        name="clock",
        description="Get the current date and time",
        function=clock,
        parameters={
            "utc_offset": {
                "param_type": "float",
                "description": "Hours east of UTC, e.g. 9 for Tokyo",
                "required": False,
                "default": 0,
            },
        },
    ),
]


def main(
    ckpt_dir: str,
    question: str = "What is 1234 * 5678, and what time is it in Tokyo (UTC+9)?",
    tool_format: str = "json",
    tokenizer_path: str = None,
    temperature: float = 0.0,
    top_p: float = DEFAULT_TOP_P,
    max_seq_len: int = 2048,
    max_gen_len: int = None,
    max_rounds: int = 4,
    device: str = None,
    dtype: str = None,
    quantize: str = None,
):
    """Lets a Llama 3.1, 3.2 or 3.3 Instruct model answer a question with two tools written in Python: a
    calculator and a clock.

    The model is told about the tools; when it calls one, this program runs the call (only these two functions,
    after checking the arguments' names and types) and sends the result back as an ipython message, until the
    model answers. Run it with python, or with torchrun and one process per model-parallel shard, e.g.
    `torchrun --nproc_per_node 1 example_tool_use.py --ckpt_dir Meta-Llama-3.1-8B-Instruct/`.

    Args:
        ckpt_dir: Checkpoint folder, Meta's layout (params.json, consolidated.NN.pth) or Hugging Face's.
        question: What to ask the model.
        tool_format: How the tools are offered and called: "json" or "function_tag" (Llama 3.1), or
            "python_list" (Llama 3.2 and 3.3).
        tokenizer_path: The tokenizer.model file; by default it is looked for in ckpt_dir and ckpt_dir/original.
        temperature: Sampling temperature; 0 (the default) always takes the most likely token.
        top_p: Nucleus sampling threshold, in (0, 1].
        max_seq_len: Tokens of dialog plus reply that the KV cache holds; the tool definitions take a few hundred.
        max_gen_len: Most tokens per reply; by default a reply may fill what is left of max_seq_len.
        max_rounds: The most replies to ask for (each tool call takes one).
        device: "cuda", "cuda:N", "cpu" or "mps"; by default CUDA if there is a GPU, else the CPU.
        dtype: "bfloat16", "float16" or "float32"; by default bfloat16 on CUDA and float32 on the CPU.
        quantize: "int8" or "int4": keep the linear layers' weights in 8 or 4 bits, quantized as they load;
            about 2x or 4x less memory than bfloat16 and faster decoding. On the CPU, dtype then defaults to bfloat16.
    """
    check_sampling(temperature, top_p, max_gen_len)  # before the minutes a load can take
    if tool_format not in TOOL_PROMPT_FORMATS:
        raise ValueError(f"tool_format must be one of {', '.join(TOOL_PROMPT_FORMATS)}; got {tool_format!r}")
    opening = tool_messages(TOOLS, tool_format=tool_format) + [{"role": "user", "content": question}]
    common.check_prompts_fit(ckpt_dir, tokenizer_path, [opening], max_seq_len, 1)
    # Every rank computes the same answers; only the first one prints them.
    sys.stdout = common.rank0_stream(sys.stdout)

    generator = Llama.build(
        ckpt_dir=ckpt_dir,
        tokenizer_path=tokenizer_path,
        max_seq_len=max_seq_len,
        max_batch_size=1,
        device=device,
        dtype=dtype,
        quantize=quantize,
    )
    print(generator.load_report)
    if generator.tokenizer.version == "3":
        print("(This checkpoint uses Llama 3's special tokens: it was not trained to call tools.)\n")
    # The model's calls are written back into the dialog in the form the tools were offered in.
    generator.formatter = ChatFormat(generator.tokenizer, tool_prompt_format=tool_format)
    dialog = chat_with_tools(
        generator, opening, TOOLS, max_rounds=max_rounds, temperature=temperature, top_p=top_p, max_gen_len=max_gen_len
    )

    print(f"User: {question}\n")
    for message in dialog[len(opening) :]:
        if message["role"] == "ipython":
            print(f"  Tool result: {message['content']}\n")
        elif message.get("tool_calls"):
            for call in message["tool_calls"]:
                arguments = ", ".join(f"{name}={value!r}" for name, value in call["arguments"].items())
                print(f"> Assistant calls {call['tool_name']}({arguments})")
        else:
            print(f"> Assistant: {message['content']}")
    if dialog[-1].get("tool_calls"):
        print(f"\n(The model was still calling tools after {max_rounds} replies; raise --max_rounds.)")


if __name__ == "__main__":
    common.run(main)
