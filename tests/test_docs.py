"""Every command in README.md and docs/ runs (issue 48): each fenced `bash` block's commands are checked the
cheapest way that still fails when the command breaks — Hydra commands compose their config (`--cfg`), argparse
CLIs answer `--help` with every flag the command uses, `make` targets exist (`make -n`), other tools' subcommands
answer `--help` with the flags used — and each `console` block (`$ command`, then its output) is run and its output
compared line by line, so a quoted output that drifts fails. Python blocks compile. A command this file does not know
how to check fails the test: teach it here rather than leave the command unchecked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from src.config import PROJECT_DIR

PAGES = [PROJECT_DIR / "README.md", *sorted((PROJECT_DIR / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# First words of lines that set up a shell or a machine (install, databases, servers); what they do is the
# environment's, not this project's. Each is named, so a new kind of command is a decision, not a silent skip.
SETUP = {"git", "cd", "pip", "export", ".", "source", "createdb", "for", "complete", "COMP_WORDBREAKS", "mlflow-server"}
ARGPARSE = {"src.report", "src.promote", "src.fit", "src.preflight", "src.same_model"}
TOOLS = {"mlflow", "optuna", "optuna-dashboard"}
SWEEP_FUNCTION = re.compile(r"^([\w./]+)=(?:choice|range|interval|tag)\((?:[^,()]*\()?([^,()]+)")


def _blocks(kind: str) -> list[tuple[str, str]]:
    """(page name, block text) of every fenced block of this kind."""
    return [
        (page.relative_to(PROJECT_DIR).as_posix(), m.group(2))
        for page in PAGES
        for m in FENCE.finditer(page.read_text())
        if m.group(1) == kind
    ]


def _commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists: continuations joined, comments and leading VAR=value dropped; a shell
    function's body (a line ending in `{` up to `}`) is one unit of set-up, skipped whole."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out, in_function = [], False
    for line in joined.splitlines():
        if re.match(r"^\s*[\w-]+\(\)\s*\{", line):
            in_function = True
        if in_function:
            in_function = not line.strip().startswith("}")
            continue
        argv = shlex.split(line, comments=True)
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def _run(argv: list[str], tmp: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "QLORA_ROOT": str(tmp), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
    return subprocess.run(argv, cwd=PROJECT_DIR, env=env, capture_output=True, text=True, timeout=timeout)


def _hydra(args: list[str]) -> list[str]:
    """`python -m src.train` as a composition only: a sweep (`-m`) composes its Hydra config with each sweep
    function's first value (the sweeper's own parsing is tested elsewhere), a run its job config."""
    if "-m" in args or "--multirun" in args:
        args = [a for a in args if a not in ("-m", "--multirun")]
        args = [SWEEP_FUNCTION.sub(r"\1=\2", a) for a in args]
        return [*args, "--cfg", "hydra"]
    return [*args, "--cfg", "job"]


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def check(argv: list[str], tmp: Path) -> str | None:
    """None when the command is sound; else what is wrong with it."""
    head = argv[0]
    if head in SETUP or head == "mlflow" and argv[1:2] == ["server"]:
        return None
    if head == "make":
        done = _run(["make", "-n", *argv[1:]], tmp)
        return None if done.returncode == 0 else f"make -n: {done.stderr.strip()[-300:]}"
    if head in ("python", "python3") and argv[1:2] == ["-m"]:
        module, args = argv[2], argv[3:]
        if module == "src.train":
            if not (PROJECT_DIR / "conf" / "experiment" / "production.yaml").exists():
                # the promoted file a fresh clone does not have yet: another experiment file composes in its place
                args = [a.replace("experiment=production", "experiment=checkpointed_sdpa") for a in args]
            done = _run([sys.executable, "-m", module, *_hydra(args)], tmp)
            return None if done.returncode == 0 else f"does not compose: {(done.stderr or done.stdout)[-600:]}"
        if module == "src.cluster":
            from src.cluster import load_cluster, split_arguments

            name, overrides, sweep_args = split_arguments(args)
            load_cluster(name, overrides)
            return check(["python", "-m", "src.train", "-m", *sweep_args], tmp)
        if module in ARGPARSE or module.split(".")[0] == "benchmarks":
            done = _run([sys.executable, "-m", module, "--help"], tmp)
            if done.returncode != 0:
                return f"--help: {done.stderr.strip()[-300:]}"
            missing = [f for f in _flags(args) if f not in done.stdout]
            return f"--help does not list {missing}" if missing else None
        return f"no check for python -m {module}: add one to tests/test_docs.py"
    if head in ("python", "python3") and argv[1:2] == ["-c"]:
        compile(argv[2], "<doc>", "exec")
        return None
    if head in TOOLS:
        words = [a for a in argv[1:] if not a.startswith("-") and "=" not in a and ":" not in a and "/" not in a]
        sub = words[:2] if head == "mlflow" else []
        exe = Path(sys.executable).parent / head
        done = _run([str(exe), *sub, "--help"], tmp)
        if done.returncode != 0:
            return f"{head} {' '.join(sub)} --help: {done.stderr.strip()[-300:]}"
        missing = [f for f in _flags(argv) if f not in done.stdout]
        return f"{head} --help does not list {missing}" if missing else None
    if head == "bash":
        script = PROJECT_DIR / argv[1]
        return None if script.is_file() else f"{argv[1]} does not exist"
    return f"no check for `{head}`: add one to tests/test_docs.py"


BASH = [(page, argv) for page, block in _blocks("bash") for argv in _commands(block)]


@pytest.mark.parametrize("page,argv", BASH, ids=[f"{p}:{' '.join(a)[:60]}" for p, a in BASH])
def test_every_documented_command_runs(page: str, argv: list[str], tmp_path: Path) -> None:
    problem = check(argv, tmp_path)
    assert problem is None, f"{page}: `{shlex.join(argv)}`: {problem}"


CONSOLE = _blocks("console")


@pytest.mark.parametrize("page,block", CONSOLE, ids=[p for p, _ in CONSOLE])
def test_every_quoted_output_is_what_the_command_prints(page: str, block: str, tmp_path: Path) -> None:
    """A `console` block: `$ command` (continued with `\\`), then exactly what it prints; a line `...` stands for
    any lines."""
    lines = block.rstrip("\n").splitlines()
    command = lines[0][2:]
    rest = lines[1:]
    while command.endswith("\\"):
        command = command[:-1] + " " + rest.pop(0).strip()
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", argv[2]], f"{page}: a console block runs `python -m ...`"
    done = _run([sys.executable, *argv[1:]], tmp_path)
    assert done.returncode == 0, done.stderr[-600:]
    printed = done.stdout.rstrip("\n").splitlines()
    pattern = "\n".join(".*?" if line == "..." else re.escape(line) for line in rest)
    assert re.fullmatch(pattern, "\n".join(printed), re.S), (
        f"{page}: the quoted output of `{command}` has drifted; it now prints:\n" + "\n".join(printed)
    )


@pytest.mark.parametrize("page,block", _blocks("python"), ids=[p for p, _ in _blocks("python")])
def test_every_python_block_compiles(page: str, block: str) -> None:
    compile(block, page, "exec")


def test_the_readme_is_a_guide_a_newcomer_reads_in_five_minutes() -> None:
    readme = (PROJECT_DIR / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: move detail to docs/"
    assert any(line.startswith("**Contents:**") for line in lines[:15]), "a contents list on the first screen"
    quick = next(i for i, line in enumerate(lines) if line.startswith("make demo"))
    assert quick < 40, "the quick start within the first 40 lines"
    prose = [line for line in lines if not line.startswith("|")]
    assert max(len(line) for line in prose) <= 120
    for page in (PROJECT_DIR / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"docs/{page.name} is linked from the README"


def test_every_relative_link_resolves() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    readme = (PROJECT_DIR / "README.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", readme, re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", readme):
        assert anchor in anchors, f"README links to #{anchor}, which no heading makes"
