"""The house stays walkable: a load goes down its steps once, no module of the package grows past a few hundred
lines, and the README stays short. The load path is measured by benchmarks/load_path.py, which prints it."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "benchmarks" / "load_path.py"
MAX_VISITS = 12
MAX_STEPS_BACK_UP = 3
MAX_MODULE_LINES = 400
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
    # The pipeline, from Llama.build: the checkpoint (params, tokenizer, weights), then the runtime layers.
    assert (root.module, root.function) == ("llama.generation", "build"), path
    assert steps.index("llama.checkpoint") < steps.index("llama.cpu") < steps.index("llama.parallel_layers"), path
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


def test_the_readme_is_short_and_its_speed_section_shorter():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details into docs/"
    start = lines.index("## Speed")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"#{1,2} ", lines[i])), len(lines))
    assert end - start <= MAX_SPEED_SECTION_LINES, f"README's Speed section has {end - start} lines"
