"""The house stays walkable: folders by concern (a few modules at the top of the package, layers importing only from
those below them, speed in llama/runtime/ alone), a load that goes down its steps once, no module past a few hundred
lines, and a short README. The load path is measured by tests/load_path.py, which prints it when run as a script."""

import ast
import re
from pathlib import Path

import load_path
import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_VISITS = 15  # the default build made 12 when the kernel table replaced load-time timing; room for a few more
MAX_STEPS_BACK_UP = 3
MAX_MODULE_LINES = 400
MAX_TOP_LEVEL_MODULES = 11
MAX_README_LINES = 200
MAX_SPEED_SECTION_LINES = 25


@pytest.mark.slow
def test_the_load_goes_down_its_steps_once(tiny_checkpoint, tokenizer_path, process_group):
    root = load_path.load_path(tiny_checkpoint, tokenizer_path)
    path = "\n".join(f"{'    ' * depth}{visit.module}.{visit.function}" for depth, visit in root.walk())
    steps = [visit.module for visit in root.calls]
    # The pipeline, from Llama.build: the checkpoint (params, tokenizer, weights), then the runtime, once.
    assert (root.module, root.function) == ("llama.generation", "build"), path
    assert steps.index("llama.checkpoint") < steps.index("llama.runtime"), path
    assert steps.count("llama.runtime") == 1, path
    assert load_path.count_visits(root) <= MAX_VISITS, path
    up = load_path.steps_back_up(root)
    assert len(up) <= MAX_STEPS_BACK_UP, f"{[f'{v.module}.{v.function}' for v in up]}\n{path}"


def test_a_step_back_up_is_counted():
    """The measure itself: a lower module calling up into the one that imports it is a step back up."""
    root = load_path.Visit("llama.generation", "build")
    checkpoint = load_path.Visit("llama.checkpoint", "load_checkpoint")
    model = load_path.Visit("llama.model", "__init__")
    callback = load_path.Visit("llama.checkpoint", "__torch_dispatch__")
    root.calls, checkpoint.calls, model.calls = [checkpoint], [model], [callback]
    assert load_path.count_visits(root) == 3
    assert load_path.steps_back_up(root) == [callback]


def test_no_module_of_the_package_is_over_400_lines():
    lengths = {path.relative_to(ROOT): len(path.read_text().splitlines()) for path in (ROOT / "llama").rglob("*.py")}
    too_long = {str(path): n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"split these by concern (at most {MAX_MODULE_LINES} lines each): {too_long}"


def test_llama_is_one_class_with_no_base_class_of_ours():
    """`Llama` holds Meta's methods and the stream methods together, as Meta's generation.py does."""
    tree = ast.parse((ROOT / "llama" / "generation.py").read_text())
    llama = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Llama")
    assert not llama.bases, [ast.unparse(base) for base in llama.bases]
    methods = {n.name for n in llama.body if isinstance(n, ast.FunctionDef)}
    assert {"build", "generate", "text_completion", "chat_completion"} <= methods
    assert {"text_completion_stream", "chat_completion_stream"} <= methods


def test_the_readme_is_short_and_its_speed_section_shorter():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details into docs/"
    start = lines.index("## Speed")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"#{1,2} ", lines[i])), len(lines))
    assert end - start <= MAX_SPEED_SECTION_LINES, f"README's Speed section has {end - start} lines"


# The seam between the reference model and its runtime (docs/internals.md) -----------------------------------

RUNTIME = ROOT / "llama" / "runtime"
# Names that reach into a built model's modules: an assignment through one of them changes a model from outside.
MODEL_PARTS = {"model", "block", "layer", "layers", "attention", "feed_forward", "kv_cache", "tok_embeddings"}


def package_modules():
    for path in sorted((ROOT / "llama").rglob("*.py")):
        yield path, ast.parse(path.read_text())


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, package: str) -> set:
    """The `llama` modules a module imports, at its top or inside its functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llama"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("llama"))
    return found


def test_no_import_cycle_in_the_package():
    modules = {module_name(path): tree for path, tree in package_modules()}
    edges = {
        name: {m for m in imported_modules(tree, name) if m in modules and m != name} for name, tree in modules.items()
    }
    # A package's __init__ importing its own modules is how a package is made, not a cycle.
    edges = {name: {m for m in targets if not m.startswith(name + ".")} for name, targets in edges.items()}
    cycles, state = [], {}

    def visit(name, path):
        state[name] = "open"
        for target in sorted(edges[name]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_no_line_is_packed_to_fit():
    packed = [str(path.relative_to(ROOT)) for path, _ in package_modules() if "fmt: skip" in path.read_text()]
    assert not packed, packed


def test_reference_attention_has_one_straight_forward():
    """model.py's `Attention.forward` is the architecture: at most one `if`, nothing another module sets."""
    tree = ast.parse((ROOT / "llama" / "model.py").read_text())
    attention = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Attention")
    forward = next(n for n in attention.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    branches = [n for n in ast.walk(forward) if isinstance(n, (ast.If, ast.IfExp))]
    assert len(branches) <= 1, ast.unparse(forward)


def test_only_the_runtime_changes_a_built_model():
    """No module outside llama/runtime/ replaces a model's layers or sets attributes on its parts: `setattr`,
    `set_submodule`, or an assignment through a model's parts (`layer.attention.kv_cache = ...`)."""
    allowed = {
        ROOT / "llama" / "model.py",  # the model's own methods (init_kv_caches) on its own modules
        ROOT / "llama" / "checkpoint" / "load.py",  # builds the model it returns: each quantized layer as it is read
    }
    found = []
    for path, tree in package_modules():
        if RUNTIME in path.parents or path in allowed:
            continue
        for node in ast.walk(tree):
            call = node.func if isinstance(node, ast.Call) else None
            if (
                isinstance(call, ast.Name)
                and call.id == "setattr"
                or isinstance(call, ast.Attribute)
                and (call.attr == "set_submodule")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                chain = ast.unparse(target).split(".")
                if isinstance(target, ast.Attribute) and chain[0] != "self" and MODEL_PARTS & set(chain[:-1]):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


# The folders by concern (docs/internals.md) ------------------------------------------------------------------------

# The modules directly in llama/: the reference's own (model.py, generation.py), the entry points (__init__, __main__,
# and demo.py and convert.py for `python -m`), and what every concern stands on (quantize.py: the quantization math,
# which checkpoint code uses without the runtime's layers; os_memory.py: the operating system's memory calls).
TOP_LEVEL = {
    "__init__",
    "__main__",
    "model",
    "generation",
    "demo",
    "convert",
    "arguments",
    "logs",
    "distributed",
    "quantize",
    "os_memory",
}
# Each part of the package, lowest first: a module may import from its own part and the parts before it only.
LAYERS = [
    {
        "llama.arguments",
        "llama.logs",
        "llama.model",
        "llama.os_memory",
        "llama.quantize",
        "llama.tokenizer",
        "llama.vision",
    },
    {"llama.distributed"},
    {"llama.runtime"},
    {"llama.checkpoint"},
    {"llama.decoding"},
    {"llama.text"},
    {"llama.generation", "llama.tools"},
    {"llama.serve", "llama.cli", "llama.demo", "llama.convert", "llama", "llama.__main__"},
]


def part_of(module: str) -> int:
    """The index in LAYERS of the part `module` (a dotted name) belongs to."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for index, layer in enumerate(LAYERS):
            if name in layer:
                return index
    raise AssertionError(f"{module} belongs to no part of LAYERS: add it there")


def test_few_modules_sit_at_the_top_of_the_package():
    top = {path.stem for path in (ROOT / "llama").glob("*.py")}
    assert len(top) <= MAX_TOP_LEVEL_MODULES and top <= TOP_LEVEL, sorted(top - TOP_LEVEL)


def test_no_import_from_a_lower_part_of_the_package_to_a_higher_one():
    modules = {module_name(path): tree for path, tree in package_modules()}
    upward = []
    for name, tree in modules.items():
        if name == "llama":  # the package's lazy exports name every part
            continue
        for imported in imported_modules(tree, name):
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and part_of(target) > part_of(name):
                upward.append(f"{name} imports {imported}")
    assert not upward, upward


def test_layers_with_kernels_of_their_own_live_in_the_runtime():
    """Every class whose product runs on a kernel of the kernel table (a CPU kernel layer, a quantized layer) is the
    runtime's, and one method says which kernel runs at a row count: `KernelLinear.kernel_for`."""
    outside, kernel_for = [], []
    for path, tree in package_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "kernel_for":
                kernel_for.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.ClassDef) and RUNTIME not in path.parents:
                bases = {ast.unparse(base).rpartition(".")[2] for base in node.bases}
                if re.search(r"(CPU|Quantized|Int[48]|Kernel)Linear", node.name) or bases & {"KernelLinear"}:
                    outside.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not outside, outside
    assert kernel_for == ["llama/runtime/parallel_layers.py"], kernel_for
