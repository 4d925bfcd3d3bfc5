"""The docs name what the code holds: every dotted name of the package written as inline code in README.md and
docs/*.md (`llama.runtime.kernel_table.CPU_TABLE`, `llama.runtime.cpu.layers.CPULinear`) resolves, the longest
importable module prefix imported and the rest looked up as attributes. Names that are not Python (`llama.cpp`, file
paths) are left out, as are fenced code blocks (commands and their output)."""

import importlib
import re
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
# An inline code span: a run of backticks, then text up to the same run, not across a blank line.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
# A dotted name from the package's root, not part of a longer word, a path or a file name with a dash.
DOTTED_NAME = re.compile(r"(?<![\w./-])llama(?:\.[A-Za-z_]\w*)+(?![\w/-])")
NOT_PYTHON = ("llama.cpp",)


def without_fenced_blocks(text: str) -> str:
    """`text` with the lines of fenced code blocks blanked (the line count kept)."""
    lines, inside = text.split("\n"), False
    for i, line in enumerate(lines):
        fence = FENCE.match(line) is not None
        if inside or fence:
            lines[i] = ""
        if fence:
            inside = not inside
    return "\n".join(lines)


def names_in(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, name) of each dotted package name in `path`'s inline code."""
    text = without_fenced_blocks(path.read_text())
    for span in CODE_SPAN.finditer(text):
        for name in DOTTED_NAME.finditer(span.group(2)):
            if name.group() in NOT_PYTHON or name.group().startswith(tuple(n + "." for n in NOT_PYTHON)):
                continue
            yield text.count("\n", 0, span.start(2) + name.start()) + 1, name.group()


def import_prefix(parts) -> Tuple[Optional[object], int, Optional[str]]:
    """(the module of the longest importable prefix of `parts`, how many parts it took, an import error other than
    the prefix's absence, or None)."""
    for count in range(len(parts), 0, -1):
        module_name = ".".join(parts[:count])
        try:
            return importlib.import_module(module_name), count, None
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # this prefix (or a package above it) is not a module: try a shorter one
            return None, count, f"importing {module_name}: {error!r}"
        except Exception as error:  # an import that fails for another reason is a fault of the code, reported
            return None, count, f"importing {module_name}: {error!r}"
    return None, 0, "no importable module"


def problem_with(name: str, cache: Dict[str, Optional[str]]) -> Optional[str]:
    """Why `name` does not resolve, or None where it does."""
    if name not in cache:
        parts = name.split(".")
        found, count, error = import_prefix(parts)
        if error is None:
            for attribute in parts[count:]:
                if not hasattr(found, attribute):
                    error = f"{'.'.join(parts[:count])} has no {attribute!r}"
                    break
                found, count = getattr(found, attribute), count + 1
        cache[name] = error
    return cache[name]


def test_every_package_name_in_the_docs_resolves():
    cache: Dict[str, Optional[str]] = {}
    checked, failures = 0, []
    for path in DOCS:
        for line, name in names_in(path):
            checked += 1
            problem = problem_with(name, cache)
            if problem is not None:
                failures.append(f"{path.relative_to(ROOT)}:{line}: `{name}` ({problem})")
    assert checked > 0, "no package names found in the docs: the pattern is broken"
    assert not failures, f"{len(failures)} names in the docs do not resolve:\n" + "\n".join(failures)


def test_the_pattern_finds_names_and_leaves_out_what_is_not_python(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See `llama.runtime.kernel_table.CPU_TABLE` and `python -m llama.demo OUT`,\n"
        "not `llama.cpp`, `llama.cpp's`, `llama/runtime/steps.py`, `ollama.image` or `llama.*`;\n"
        "a span over two lines `Llama.build(...,\nquantize=llama.quantize.QUANTIZE_SCHEMES)`.\n"
        "```bash\npython -m llama.not_checked\n```\n"
    )
    assert list(names_in(page)) == [
        (1, "llama.runtime.kernel_table.CPU_TABLE"),
        (1, "llama.demo"),
        (4, "llama.quantize.QUANTIZE_SCHEMES"),
    ]
    cache: Dict[str, Optional[str]] = {}
    assert problem_with("llama.runtime.kernel_table.CPU_TABLE", cache) is None
    assert "has no 'NO_SUCH_NAME'" in problem_with("llama.runtime.kernel_table.NO_SUCH_NAME", cache)
    assert problem_with("llama.runtime.no_such_module", cache) is not None
