"""The layout holds: every module of src/ says what it owns; no two modules import each other (directly or round a
loop, an import of `a.b.c` counting as one of the packages `a.b` whose `__init__` it runs); no import runs up a floor
(FLOORS); no module imports another's private name; no module or class outgrows one reading; and private attributes
of other libraries are reached only where no public API exists, each named here."""

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
    "layer._gradient_checkpointing_func": "transformers' checkpoint call of a decoder layer (set by its "
    "activation_checkpointing_enable, no getter): selective recompute compiles it with the layer in it",
    "trainer._get_train_sampler": "the Trainer's one place that builds the training sampler (no argument sets "
    "LengthGroupedSampler's generator): a resumed group_by_length epoch must be ordered as the interrupted one",
    "trainer._load_from_checkpoint": "the Trainer's reload of a checkpoint's adapter, which upcasts a bf16 adapter "
    "(peft's autocast_adapter_dtype, no argument reaches it): a resume keeps the adapter's dtype",
}


# The floors, ground first: a module may import its own floor's modules and those below, never above. A module's
# floor is the one of its longest prefix here (src.fit.setting and src.fit.model stand below the rest of src.fit).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground: names and words every floor reads",
        (
            "src",
            "src.record",
            "src.knobs",
            "src.failures",
            "src.redact",
            "src.config",
            "src.quiet",
            "src.gpus",
            "src.handoff",
            "src.attention",
            "src.recompute",
        ),
    ),
    (
        "the stores and the data",
        (
            "src.tracking",
            "src.stores",
            "src.faults",
            "src.tables",
            "src.data",
            "src.checkpoints",
            "src.fit.setting",
            "src.fit.model",
        ),
    ),
    ("the model, its measurement and its checks", ("src.models", "src.measure", "src.preflight")),
    ("the memory model's fit", ("src.fit",)),
    ("one trial", ("src.trial", "src.same_model")),
    ("a study as it is read", ("src.places", "src.study", "src.readings")),
    ("the sweep", ("src.sweep",)),
    ("the report", ("src.report",)),
    ("promotion", ("src.promote",)),
    ("the entry points", ("src.train", "src.cluster")),
]


def floor(module: str) -> int:
    """The floor of `module`: of its longest prefix in FLOORS."""
    best = (-1, -1)
    for number, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), number))
    assert best[1] >= 0, f"{module} stands on no floor: add it to FLOORS"
    return best[1]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(PROJECT_DIR).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The src modules `name` imports anywhere in its body (a lazy import inside a function counts too), with the
    packages whose `__init__` each import runs (those `name` is not inside of: its own package is running)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    # Its own packages are running already (a module's import of its package, or of a sibling, adds no edge to them)
    return {t for t in out if t in modules and t != name and not name.startswith(t + ".")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ importing its own modules is no cycle with them: their imports of the package's modules
    # count no edge back to the package (_imports).
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_opens_with_what_it_owns() -> None:
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc or name == "src", f"{path.relative_to(PROJECT_DIR)} opens without a docstring"


def test_no_import_cycles() -> None:
    graph = _graph()
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


def test_no_import_runs_up_a_floor() -> None:
    up = [
        f"{name} (floor {floor(name)}) imports {target} (floor {floor(target)}: {FLOORS[floor(target)][0]})"
        for name, targets in sorted(_graph().items())
        for target in sorted(targets)
        if floor(target) > floor(name)
    ]
    assert not up, "imports that run up a floor:\n" + "\n".join(up)


def test_no_module_imports_another_modules_private_names() -> None:
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("src"):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name[:1] == "_" != a.name[1:2]]
    assert not found, f"private names imported from other modules: {found}"


def test_private_attributes_of_other_libraries_only_where_no_public_api_exists() -> None:
    used = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            private = isinstance(node, ast.Attribute) and node.attr[:1] == "_" and node.attr[:2] != "__"
            if private and ast.unparse(node.value) not in ("self", "cls"):
                used.add(ast.unparse(node))
    used = {u for u in used if not any(a != u and a.startswith(u + ".") for a in used)}  # the longest chains
    assert used <= set(PRIVATE_ALLOWED), f"private attributes without a reason: {sorted(used - set(PRIVATE_ALLOWED))}"


def test_the_layout_table_names_every_module() -> None:
    readme = (PROJECT_DIR / "docs" / "development.md").read_text()
    table = readme[readme.index("- Layout (") : readme.index("`hydra_plugins/` registers the sweeper.")]
    missing = []
    for name, path in _modules().items():
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            named = len(parts) == 1 or f"`src/{'/'.join(parts[:-1])}/`" in table
        else:
            named = f"`{parts[-1]}`" in table or f"{parts[-1]}.py" in table
        if not named:
            missing.append(name)
    assert not missing, f"modules the layout table of docs/development.md does not name: {missing}"


# How big a module or a class may grow before it is split (issue 27): a file read in one sitting, a class whose
# methods fit in one head.
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250


def test_no_module_or_class_outgrows_one_reading() -> None:
    too_big = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(PROJECT_DIR)
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            too_big.append(f"{where}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                too_big.append(f"{where}: class {node.name} is {size} lines (at most {MAX_CLASS_LINES})")
    assert not too_big, "split these: " + "; ".join(too_big)
