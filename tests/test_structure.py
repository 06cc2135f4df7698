"""The shape of the house (docs/architecture.md): dragon's packages in layers, each importing only
the layers below it, no import circle among its modules, the model knowing nothing of DeepSpeed,
every assignment to a DeepSpeed engine's attribute in dragon.parallel.deepspeed_fixes, and one
meaning per file name."""

import ast
import re
from pathlib import Path

from conftest import REPO

# A package imports its own modules and the layers below it, never one at its level or above.
LAYERS = {"errors": 0, "history": 0, "version": 0, "model": 1, "data": 1, "wire": 1,
          "parallel": 2, "checkpoint": 3, "diloco": 4, "run": 5}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / "dragon").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """The dragon modules `path` imports, anywhere in it (a function's own imports too), but for
    those under `if TYPE_CHECKING:`, which annotations alone use."""
    names, tree = set(), ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dragon"):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("dragon"))
    return names


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: {m for m in imports(path) if m in found and m != name}
            for name, path in found.items()}


def package(module: str) -> str:
    return module.split(".")[1] if "." in module else "dragon"


def test_every_package_imports_only_the_layers_below_it():
    upward = [(a, b) for a, targets in graph().items() for b in targets
              if package(a) in LAYERS and package(b) in LAYERS and package(a) != package(b)
              and LAYERS[package(b)] >= LAYERS[package(a)]]
    assert upward == []


def test_no_module_imports_more_than_ten_dragon_modules():
    """A module that needs more than ten others does too much: split it."""
    wide = {name: len(uses) for name, uses in graph().items() if len(uses) > 10}
    assert not wide, wide


def test_no_two_modules_share_a_file_name():
    """A file name means one thing across the packages (a package's face, __init__, aside)."""
    names = [path.name for path in modules().values() if path.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_no_module_is_in_an_import_circle():
    edges, circles = graph(), []
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                walk(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module, [module])
    assert circles == []


def test_the_model_knows_nothing_of_deepspeed_or_the_rest_of_dragon():
    for name, path in modules().items():
        if package(name) == "model":
            text = path.read_text()
            assert not re.search(r"^\s*(import|from) deepspeed", text, re.M), name
            assert {package(m) for m in imports(path)} <= {"model", "errors"}, name


def test_engine_attributes_are_set_only_by_the_fixes_module():
    """An assignment to `engine.<attribute>` or `<engine>.optimizer.<attribute>` lives in
    dragon/parallel/deepspeed_fixes.py; the retention hook's one wrap of engine.save_checkpoint
    is the exception the project names."""
    assignment = re.compile(r"^\s*[\w.]*(engine|optimizer)\.\w+(\s*=[^=]|\s*=$)", re.M)
    found = []
    for name, path in modules().items():
        if name == "dragon.parallel.deepspeed_fixes":
            continue
        for line in path.read_text().splitlines():
            if assignment.match(line) and not line.strip().startswith("engine.save_checkpoint ="):
                found.append(f"{name}: {line.strip()}")
    assert found == []
