"""The house stays walkable: a load goes down its steps once, no module of the package grows past a few hundred
lines, and the README stays short. The load path is measured by benchmarks/load_path.py, which prints it."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "benchmarks" / "load_path.py"
MAX_VISITS = 15  # 12, and a cached kernel choice re-checked once (timing, its call, the rank that logs)
MAX_STEPS_BACK_UP = 3
MAX_MODULE_LINES = 400
MAX_LLAMA_CLASS_LINES = 200
MAX_README_LINES = 200
MAX_SPEED_SECTION_LINES = 25


@pytest.fixture(scope="module")
def load_path():
    spec = importlib.util.spec_from_file_location("load_path", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_load_goes_down_its_steps_once(load_path, tiny_checkpoint, tokenizer_path, process_group):
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


def test_a_step_back_up_is_counted(load_path):
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


def test_the_llama_class_stays_a_thin_orchestrator():
    """`Llama` ties loading, the runtime and decoding together; the work itself lives in modules below it."""
    tree = ast.parse((ROOT / "llama" / "generation.py").read_text())
    llama = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Llama")
    assert llama.end_lineno - llama.lineno + 1 <= MAX_LLAMA_CLASS_LINES


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
        ROOT / "llama" / "parallel_layers.py",  # a runtime layer takes over the weight of the fairscale layer it wraps
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
