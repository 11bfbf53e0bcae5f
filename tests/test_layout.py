"""The layout holds: every module of src/ says what it owns, no two modules import each other (directly or round a
loop), and private attributes of other libraries are reached only where no public API exists, each named here."""

from __future__ import annotations

import ast
from pathlib import Path

from src.config import PROJECT_DIR

SRC = PROJECT_DIR / "src"
# Private attributes of other libraries that src/ uses, and why no public API serves (checked against torch 2.11-2.13).
PRIVATE_ALLOWED = {
    "torch._C._nn._parse_to": "how nn.Module.to reads its arguments; the 4-bit guard must read them alike",
    "model._apply": "nn.Module's one path for every move or cast (to, cuda, half, wrappers): the 4-bit guard wraps it",
    "torch.cuda._is_in_bad_fork": "the only way to ask whether a forked child inherited a CUDA context",
    "func._schema": "an aten op's name as the dispatcher sees it (which attention kernel ran)",
    "os._exit": "a data-parallel rank leaves without tearing down gloo (documented os API)",
    "forkserver._forkserver": "multiprocessing's one ForkServer, whose pipe a forked trial must let go of",
    "server._forkserver_alive_fd": "the forkserver's 'alive' pipe each forked child is handed (no public handle)",
    "server._forkserver_address": "cleared with the pipe: a forkserver a trial asks for later is its own",
    "self.storage._get_stale_trial_ids": "Optuna's stale trials without failing them: their records are read first",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(PROJECT_DIR).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The src modules `name` imports anywhere in its body (a lazy import inside a function counts too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def test_every_module_opens_with_what_it_owns() -> None:
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc or name == "src", f"{path.relative_to(PROJECT_DIR)} opens without a docstring"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ re-exporting its own modules is not a cycle with them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(node) :], node]))
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, [*trail, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_private_attributes_of_other_libraries_only_where_no_public_api_exists() -> None:
    used = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            private = isinstance(node, ast.Attribute) and node.attr[:1] == "_" and node.attr[:2] != "__"
            if private and ast.unparse(node.value) not in ("self", "cls"):
                used.add(ast.unparse(node))
    used = {u for u in used if not any(a != u and a.startswith(u + ".") for a in used)}  # the longest chains
    assert used <= set(PRIVATE_ALLOWED), f"private attributes without a reason: {sorted(used - set(PRIVATE_ALLOWED))}"
