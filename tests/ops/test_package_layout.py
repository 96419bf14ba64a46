"""The package's shape: no module of mita/ over 800 lines, no function over 150 lines (from its def line to the end
of its body, decorators excluded; Triton kernels and their @triton.jit helpers included), and no import cycle among
mita's modules (imports parsed with ast, function-level ones included; ``from pkg import name`` counts as an import
of ``pkg.name`` when that is a module, else of ``pkg``; importing a module is not counted as importing its parent
packages)."""

from __future__ import annotations

import ast
from pathlib import Path

MITA = Path(__file__).resolve().parents[2] / "mita"
MAX_LINES = 800
MAX_FUNCTION_LINES = 150


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module under mita/ (packages by their __init__.py)."""
    out = {}
    for path in sorted(MITA.rglob("*.py")):
        parts = path.relative_to(MITA.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the mita modules it imports anywhere in its body (module level, functions, try blocks)."""
    graph = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"x": {"y"}, "y": set(), "p": {"q"}, "q": {"p"}}) == ["p", "q", "p"]


def test_import_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "mita"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from mita.sub import b\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from mita.sub.b import g\n    return g\n")
    (pkg / "sub" / "b.py").write_text("from . import a\nimport os\n")
    modules = {
        "mita": pkg / "__init__.py",
        "mita.sub": pkg / "sub" / "__init__.py",
        "mita.sub.a": pkg / "sub" / "a.py",
        "mita.sub.b": pkg / "sub" / "b.py",
    }
    graph = import_graph(modules)
    assert graph == {
        "mita": set(),
        "mita.sub": {"mita.sub.b"},
        "mita.sub.a": {"mita.sub.b"},
        "mita.sub.b": {"mita.sub.a"},
    }
    assert find_cycle(graph) == ["mita.sub.b", "mita.sub.a", "mita.sub.b"]


def test_no_module_over_800_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def long_functions(path: Path, limit: int) -> dict[str, int]:
    """Qualified name -> length of each function (methods and nested functions too) in the file longer than limit."""
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    out[name] = n
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_long_functions_counts_from_the_def_line(tmp_path):
    path = tmp_path / "m.py"
    lines = ["@decorator", "def f():", *[f"    x{i} = {i}" for i in range(4)], "", "", "class C:", "    def g(self):"]
    lines += ["        def h():", *[f"            x{i} = {i}" for i in range(4)]]
    path.write_text("\n".join(lines) + "\n")
    assert long_functions(path, 4) == {"f": 5, "C.g": 6, "C.g.h": 5}
    assert long_functions(path, 5) == {"C.g": 6}


def test_no_function_over_150_lines():
    long = {
        f"{name}.{fn}": n
        for name, path in _modules().items()
        for fn, n in long_functions(path, MAX_FUNCTION_LINES).items()
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_cycle_in_mita():
    graph = import_graph(_modules())
    # The graph is the real one: the operator reaches the kernels, the kernels their shared pieces.
    assert "mita.ops.mita.triton.backend" in graph["mita.ops.mita.api"]
    assert "mita.ops.mita.triton.op" in graph["mita.ops.mita.triton"]
    assert "mita.ops.mita.triton.common" in graph["mita.ops.mita.triton.topk"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_and_models_use_only_the_public_op():
    """mita/layers and mita/models import the operator's public names (mita.ops, mita.ops.mita, landmark pooling),
    never the backend packages or the op's internal modules."""
    allowed = {"mita.ops", "mita.ops.mita", "mita.ops.landmarks"}
    found = []
    for folder in ("layers", "models"):
        for path in sorted((MITA / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mita.ops"):
                    found.append((path.name, node.module))
                elif isinstance(node, ast.Import):
                    found += [(path.name, a.name) for a in node.names if a.name.startswith("mita.ops")]
    assert found, "no import of the operator found: the scan is broken"
    assert [f for f in found if f[1] not in allowed] == []
