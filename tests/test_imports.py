"""The import rule of docs/architecture.md, read from the source: no import circle between modules or
between the package's rooms (its subpackages and top-level modules), kernels are leaves, and the
scheduler's room never imports torch. Every import counts, also one inside a function or under
TYPE_CHECKING: a late import is a circle kept out of sight, not one removed."""
import ast
from pathlib import Path

import nanovllm

PACKAGE = Path(nanovllm.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def owner(name: str) -> str:
    """The package module an imported name lives in (a module, or the package that defines it)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(package modules, outside top-level packages) that a module imports."""
    path = MODULES[module]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:       # relative: from the module's own package upwards
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "nanovllm":
                inside.add(owner(name))
            else:
                outside.add(name.split(".")[0])
    inside.discard(module)
    return inside, outside


GRAPH = {module: imports_of(module) for module in MODULES}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_the_reader_finds_real_imports():
    inside, outside = GRAPH["nanovllm.engine.llm_engine"]
    assert "nanovllm.engine.core" in inside and "transformers" in outside
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_round_a_circle():
    assert circles({module: inside for module, (inside, _) in GRAPH.items()}) == []


def test_no_circle_between_rooms():
    rooms: dict[str, set[str]] = {}
    for module, (inside, _) in GRAPH.items():
        rooms.setdefault(room(module), set()).update(room(other) for other in inside if room(other) != room(module))
    assert circles(rooms) == []


def test_kernels_are_leaves_and_the_scheduler_touches_no_tensor():
    for module, (inside, outside) in GRAPH.items():
        if room(module) == "kernels":
            assert {room(other) for other in inside} <= {"kernels"}, module
        if room(module) == "core":
            assert "torch" not in outside and {room(other) for other in inside} <= {"core", "config",
                                                                                      "sampling_params"}, module
