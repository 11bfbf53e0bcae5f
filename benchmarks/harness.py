"""One harness for every benchmark. A benchmark is a definition, benchmarks/suites/<name>.yaml: the product's own
commands (`python -m src.train ...`, a sweep, `python -m src.same_model`, ...) or a list of trial settings, each run
as a user runs it, and the summary (a function of benchmarks/summaries.py) that reads what they left. Steps run one
after another; consecutive steps marked `together: true` run at the same time (what shares a card is said so).

    python -m benchmarks list                                  # the benchmarks, one line each
    python -m benchmarks run NAME [key=value ...] [--out DIR] [--deadline-s S]
    python -m benchmarks run NAME [...] --detach [--wait S]    # GPU machine: outlives the device call ...
    python -m benchmarks collect NAME [--wait S]               # ... the next call waits for the rest
    python -m benchmarks summarize FILE                        # the summary again from a result file's rows
    python -m benchmarks index                                 # README rows for result files it does not list

On the GPU machine: `source benchmarks/gpu_stack.sh` first (the stack, carried as .whl: gpu_wheels.sh). Every
benchmark runs in a fresh QLORA_ROOT of its own (<QLORA_ROOT or the temp dir>/benchmarks/<name>: its studies, MLflow
store and rows start empty; the model cache, QLORA_CACHE, is shared). The result, <out>/<name>_<card>.json (`--out`,
else $OUT, else benchmarks/results/), is named by the card that measured it and records the card and its driver,
the versions, the date, the commit, the command, each product command with its row, and the summary; it is rewritten
after every row, so a call cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from src.config import PROJECT_DIR, override_value
from src.redact import redact_text

SUITES = PROJECT_DIR / "benchmarks" / "suites"
RESULTS = PROJECT_DIR / "benchmarks" / "results"
README = PROJECT_DIR / "benchmarks" / "README.md"
KEYS = {"what", "vars", "prepare", "steps", "summary"}
STEP_KEYS = {"name", "run", "timeout_s", "env", "result", "arm", "together"}
TRIAL_KEYS = {"common", "settings", "design", "repeats", "slots", "timeout_s"}
STOP_GRACE_S = 20  # a timed-out command's Ctrl-C first (a sweep closes its runs), then its whole session is killed


@dataclass
class Run:
    """One run of a benchmark: its definition, its variables, where its commands write, and its record."""

    name: str
    suite: dict[str, Any]
    vars: dict[str, str]
    root: Path  # QLORA_ROOT of its commands
    out: Path  # the result file
    record: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: set[subprocess.Popen] = field(default_factory=set)  # stopped with the harness (each has its own session)

    @property
    def work(self) -> Path:
        return self.root / "rows"

    def fill(self, text: str, **more: str) -> str:
        """`${var}` of the benchmark's variables (and root, out, work, card, row); other `${...}` stay Hydra's."""
        values = {**self.vars, "root": str(self.root), "out": str(self.out.parent), "work": str(self.work),
                  "card": self.record.get("card", ""), **more}  # fmt: skip
        return string.Template(text).safe_substitute(values)


def load(name: str) -> dict[str, Any]:
    path = SUITES / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"no benchmark '{name}': {path} does not exist (python -m benchmarks list)")
    suite = yaml.safe_load(path.read_text()) or {}
    unknown = set(suite) - KEYS
    for step in suite.get("steps", []):
        unknown |= set(step) - STEP_KEYS - {"trials"} | set(step.get("trials", {})) - TRIAL_KEYS
    if unknown:
        raise SystemExit(f"{path}: unknown key(s) {sorted(unknown)}; a definition has {sorted(KEYS)}")
    return suite


def card() -> tuple[str, str, str]:
    """(the GPU's name, its driver, the card's short name for file names: h100, h200, h200x2) from nvidia-smi;
    ('none (cpu)', '', 'cpu') without one."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=60, check=False)
        lines = [line for line in done.stdout.strip().splitlines() if line.strip()] if done.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        lines = []
    if not lines:
        return "none (cpu)", "", "cpu"
    name, _, driver = (part.strip() for part in lines[0].partition(","))
    return name, driver, card_of(name) + (f"x{len(lines)}" if len(lines) > 1 else "")


def card_of(gpu: str) -> str:
    """The card a GPU's name names, as result files are named: 'NVIDIA H100 80GB HBM3' -> h100."""
    found = re.search(r"\b([A-Z]+\d+[A-Z]*)\b", gpu.replace("NVIDIA", ""))
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_") or "unknown"


def commit() -> str | None:
    """The checkout's commit (with `-dirty` when files differ from it); None where no git history came along
    (the GPU machine's copy: the index then takes the commit that added the result file)."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=PROJECT_DIR,
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def plan(run: Run) -> list[list[dict[str, Any]]]:
    """The benchmark's commands in order, grouped: a step alone, a trials block's trials together (run `slots` at a
    time). Each: the row's name, the argv after `python -m`, its limit, environment and result file."""
    groups = []
    for step in run.suite.get("steps", []):
        if "trials" not in step:
            name = step["name"]
            argv = shlex.split(run.fill(step["run"], row=str(run.work / name)))
            result = step.get("result")
            if argv[0] == "src.train" and "-m" not in argv:  # a single run writes its result.json in its run dir
                argv.append(f"hydra.run.dir={run.work / name}")
                result = result or "${row}/result.json"
            item = {"name": name, "argv": argv, "timeout_s": step.get("timeout_s"), "env": step.get("env"),
                    "result": result and run.fill(result, row=str(run.work / name)), "arm": step.get("arm")}  # fmt: skip
            if step.get("together") and groups and groups[-1][0].get("together"):  # at once with the step before
                groups[-1].append(item)
                for one in groups[-1]:
                    one["slots"] = len(groups[-1])
            else:
                groups.append([{**item, "together": bool(step.get("together")), "slots": 1}])
            continue
        block = step["trials"]
        settings = dict(block.get("settings") or {})
        if block.get("design"):  # a list of settings ({key: value}) in a committed file: "path:key"
            path, _, key = run.fill(block["design"]).partition(":")
            found = json.loads((PROJECT_DIR / path).read_text())[key or "held_out"]
            first = int(run.vars["first"]) if run.vars.get("first") else None
            settings |= {f"{key}{i}": s for i, s in enumerate(found[:first])}
        common = shlex.split(run.fill(block.get("common", "")))
        repeats = int(run.fill(str(block.get("repeats", 1))))
        trials = []
        for r in range(repeats):  # round-robin: a drift of the card hits every setting alike
            for label, setting in settings.items():
                name = label if repeats == 1 else f"{label}.{r + 1}"
                row = run.work / name
                words = (shlex.split(run.fill(setting)) if isinstance(setting, str)
                         else [f"{k}={override_value(v)}" for k, v in setting.items()])  # fmt: skip
                # its own checkpoints: a repeat of the same setting must not find the last one's finished run
                argv = ["src.train", *common, *words, f"hydra.run.dir={row}", f"checkpoint.dir={row}/checkpoints"]
                trials.append({"name": name, "argv": argv, "timeout_s": block.get("timeout_s"), "env": None,
                               "result": str(row / "result.json"), "arm": label, "overrides": words,
                               **({"setting": setting} if isinstance(setting, dict) else {})})  # fmt: skip
        groups.append([{**t, "slots": int(run.fill(str(block.get("slots", 1))))} for t in trials])
    return groups


def execute(run: Run, item: dict[str, Any]) -> dict[str, Any]:
    """One command as a user types it, from the checkout, in a session of its own; its row."""
    folder = run.work / item["name"]
    shutil.rmtree(folder, ignore_errors=True)  # nothing of an earlier run is read as this one's
    folder.mkdir(parents=True)
    env = {
        **os.environ,
        "QLORA_ROOT": str(run.root),
        **{k: run.fill(str(v), row=str(folder)) for k, v in (item.get("env") or {}).items()},
    }
    started = time.time()
    with (folder / "output.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *item["argv"]], cwd=PROJECT_DIR, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        run.live.add(proc)
        try:
            rc = proc.wait(item.get("timeout_s"))
        except subprocess.TimeoutExpired:
            rc = stop(proc)
        finally:
            run.live.discard(proc)
    row = {"name": item["name"], "command": "python -m " + shlex.join(item["argv"]), "exit_code": rc,
           "wall_s": round(time.time() - started, 2), "started": stamp(started)}  # fmt: skip
    row |= {k: item[k] for k in ("arm", "overrides", "setting") if item.get(k) is not None}
    text = (folder / "output.log").read_text(errors="replace")
    result = Path(item["result"]) if item.get("result") else None
    if result is not None and result.exists():
        row["result"] = json.loads(result.read_text())
    elif (output := last_json(text)) is not None:  # a command that answers in JSON (src.same_model)
        row["output"] = output
    if rc != 0:
        row["tail"] = text.strip().splitlines()[-8:]
    return row


def stop(proc: subprocess.Popen) -> int:
    """A command past its limit: Ctrl-C to its session (a sweep ends its trials and closes its runs), then kill."""
    for sig, wait in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, 60)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    return 124  # timeout's own code: classify_exit reads it as a timeout


def last_json(text: str) -> Any:
    """The JSON object a command printed last, where its output ends with one."""
    start = text.rfind("\n{")
    try:
        return json.loads(text[start + 1 :] if start >= 0 else text) if text.rstrip().endswith("}") else None
    except ValueError:
        return None


def stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def write(run: Run) -> None:
    """The record, redacted, whole or not at all: a call cut short mid-write keeps the last whole one."""
    run.out.parent.mkdir(parents=True, exist_ok=True)
    partial = run.out.with_suffix(".partial")
    partial.write_text(redact_text(json.dumps(run.record, indent=2, default=str)) + "\n")
    os.replace(partial, run.out)


def summarize(run: Run) -> None:
    from benchmarks import summaries

    if not run.suite.get("summary"):  # the rows are the figures
        return
    try:
        run.record["summary"] = getattr(summaries, run.suite["summary"])(run.record, run)
        run.record.pop("summary_error", None)
    except Exception as exc:  # noqa: BLE001 - the rows are kept; the summary can be made again from the file
        run.record["summary_error"] = f"{type(exc).__name__}: {exc} (python -m benchmarks summarize {run.out})"


def benchmark_root(name: str) -> Path:
    """The QLORA_ROOT of a benchmark's commands: a folder of its own under QLORA_ROOT (else the temp dir)."""
    return Path(os.environ.get("QLORA_ROOT") or tempfile.gettempdir()) / "benchmarks" / name


def start(name: str, assignments: list[str], out_dir: Path | None, argv: list[str]) -> Run:
    suite = load(name)
    given = dict(a.split("=", 1) for a in assignments)
    unknown = set(given) - set(suite.get("vars") or {}) - {"first"}
    if unknown:
        raise SystemExit(f"{name}: no variable {sorted(unknown)}; it has {sorted(suite.get('vars') or {})}")
    gpu, driver, short = card()
    root = benchmark_root(name)
    shutil.rmtree(root, ignore_errors=True)  # a fresh store: a rerun never resumes an earlier run's study
    root.mkdir(parents=True)
    os.environ.setdefault("QLORA_CACHE", str(PROJECT_DIR / ".cache"))  # the product's default cache: shared
    out_dir = out_dir or Path(os.environ.get("OUT") or RESULTS)
    variables = {k: str(v) for k, v in (suite.get("vars") or {}).items()} | given
    run = Run(name, suite, variables, root, out_dir / f"{name}_{short}.json")
    from src.tracking import versions

    run.record = {"benchmark": name, "what": suite.get("what"), "gpu": gpu, "driver": driver, "card": short,
                  "versions": versions(), "python": sys.version.split()[0], "date": stamp(time.time()),
                  "commit": commit(), "command": "python -m benchmarks " + shlex.join(argv), "vars": variables}  # fmt: skip
    return run


def run_benchmark(run: Run, deadline_s: float | None) -> int:
    from benchmarks import summaries

    started = time.time()
    if run.suite.get("prepare"):
        getattr(summaries, run.suite["prepare"])(run)
    groups = plan(run)
    run.record["commands"] = ["python -m " + shlex.join(i["argv"]) for g in groups for i in g]
    run.record["rows"] = []
    write(run)

    def one(item: dict[str, Any]) -> None:
        if deadline_s is not None and time.time() - started > deadline_s:
            row = {"name": item["name"], "command": "python -m " + shlex.join(item["argv"]), "status": "not_run",
                   "why": f"past --deadline-s {deadline_s:g}", **{k: item[k] for k in ("arm", "setting") if k in item}}  # fmt: skip
        else:
            row = execute(run, item)
        with run.lock:
            run.record["rows"].append(row)
            run.record["wall_s"] = round(time.time() - started, 1)
            write(run)
        status = (row.get("result") or {}).get("status") or row.get("status") or f"exit {row.get('exit_code')}"
        print(f"{row['name']}: {status} in {row.get('wall_s', 0):.0f} s", flush=True)

    pool = None
    try:
        for group in groups:
            pool = ThreadPoolExecutor(max(1, group[0].get("slots", 1)))
            list(pool.map(one, group))
            pool.shutdown()
    except BaseException:  # Ctrl-C, or SIGTERM made one: nothing it started goes on holding the card
        for proc in list(run.live):
            stop(proc)
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # after the stop: a running row ends (as a timeout) and is kept
        run.record["interrupted"] = f"after {len(run.record['rows'])} of {len(run.record['commands'])} commands"
        write(run)
        raise
    summarize(run)
    write(run)
    print(f"wrote {run.out}" + (f"; summary failed: {run.record['summary_error']}" if "summary_error" in run.record
                                else ""), flush=True)  # fmt: skip
    return 1 if "summary_error" in run.record else 0


def again(path: Path) -> int:
    """The summary made again from a result file's rows (here, after the GPU run, or after a change to it)."""
    record = json.loads(path.read_text())
    name = record["benchmark"]
    run = Run(name, load(name), record.get("vars", {}), benchmark_root(name), path, record)
    summarize(run)
    write(run)
    print(json.dumps(record.get("summary") or record.get("summary_error"), indent=2, default=str)[:4000])
    return 1 if "summary_error" in record else 0


def detach(name: str, forward: list[str], wait_s: float) -> int:
    """The run in a session of its own from a copy of the checkout (the device call's tree may be replaced under
    it), writing into QLORA_ROOT; this call waits up to `wait_s` and brings back what it wrote."""
    copy = Path(tempfile.gettempdir()) / f"benchmark-{name}"
    shutil.rmtree(copy, ignore_errors=True)
    for part in ("benchmarks", "conf", "data", "hydra_plugins", "src", "pyproject.toml"):
        (shutil.copytree if (PROJECT_DIR / part).is_dir() else shutil.copy)(PROJECT_DIR / part, copy / part)
    spool = copy / "out"
    command = shlex.join([sys.executable, "-m", "benchmarks", "run", name, *forward, "--out", str(spool)])
    subprocess.Popen(["bash", "-c", f"{command} > run.log 2>&1; echo rc=$? >> run.log; touch done"], cwd=copy,
                     env={**os.environ, "OUT": str(spool)}, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return collect(name, wait_s)


def collect(name: str, wait_s: float) -> int:
    copy = Path(tempfile.gettempdir()) / f"benchmark-{name}"
    if not copy.exists():
        raise SystemExit(f"no detached run of '{name}' here ({copy}): the machine was given back, or it never ran")
    deadline = time.time() + wait_s
    while not (copy / "done").exists() and time.time() < deadline:
        time.sleep(1)
    if os.environ.get("OUT"):  # what it wrote so far comes back with this call
        shutil.copytree(copy / "out", os.environ["OUT"], dirs_exist_ok=True)
        shutil.copy(copy / "run.log", os.environ["OUT"])
    print("\n".join((copy / "run.log").read_text(errors="replace").splitlines()[-20:]))
    if (copy / "done").exists():
        return 0
    print(f"still running: python -m benchmarks collect {name} (the next call, while this machine is warm)")
    return 3


def index() -> int:
    """The README table's rows for result files it does not list yet, from their own fields (append them)."""
    listed = README.read_text()
    for path in sorted(RESULTS.iterdir()):
        if f"`{path.name}" in listed:
            continue
        head = json.loads(path.read_text()) if path.suffix == ".json" else {}
        print(f"| `{path.name}` | {head.get('gpu', '?')} | {str(head.get('date', '?'))[:10]} | {head.get('what', '')} "
              f"| `{head.get('command', '?')}` @ {head.get('commit') or 'its commit'} |")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("list")
    r = sub.add_parser("run")
    r.add_argument("name")
    r.add_argument("vars", nargs="*", help="key=value: the definition's variables")
    r.add_argument("--out", type=Path, default=None, help="folder of the result file (default $OUT, else results/)")
    r.add_argument("--deadline-s", type=float, default=None, help="no command starts after this many seconds")
    r.add_argument("--detach", action="store_true", help="in a session of its own (then: collect NAME)")
    r.add_argument("--wait", type=float, default=570, help="--detach, collect: seconds this call waits")
    c = sub.add_parser("collect")
    c.add_argument("name")
    c.add_argument("--wait", type=float, default=570)
    s = sub.add_parser("summarize")
    s.add_argument("file", type=Path)
    sub.add_parser("index")
    args = p.parse_args(argv)
    if args.what == "list":
        for path in sorted(SUITES.glob("*.yaml")):
            print(f"{path.stem:22} {yaml.safe_load(path.read_text()).get('what', '')}")
        return 0
    if args.what == "collect":
        return collect(args.name, args.wait)
    if args.what == "summarize":
        return again(args.file)
    if args.what == "index":
        return index()
    bad = [a for a in args.vars if "=" not in a]
    if bad:
        raise SystemExit(f"{bad[0]}: a variable is key=value (python -m benchmarks run {args.name} key=value)")
    if args.detach:
        forward = [*args.vars, *(["--deadline-s", str(args.deadline_s)] if args.deadline_s else [])]
        return detach(args.name, forward, args.wait)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: what it started is stopped first
    return run_benchmark(start(args.name, args.vars, args.out, argv), args.deadline_s)
