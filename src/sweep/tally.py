"""What a sweep process shows while it runs and when it ends: counts of trials by outcome, the best so far, a
progress bar on the terminal, and the closing summary with where everything went.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import optuna
from omegaconf import DictConfig

from src import record
from src.knobs import figure
from src.record import failure_kind, retried_numbers
from src.redact import redact_text
from src.sweep.storage import FINISHED

# skip.reason in words: (one, several)
_SKIP_WORDS = {
    "repeat": ("repeat", "repeats"),
    "certain_oom": ("certain OOM", "certain OOMs"),
    "predicted_oom": ("predicted OOM", "predicted OOMs"),
}


class Tally:
    def __init__(
        self, study_name: str, objective: str, maximize: bool, margin: float = 0.0, policy: float | None = None
    ) -> None:
        self.study_name = study_name
        self.objective = objective
        self.maximize = maximize
        # the best so far is a setting the report could call best: it keeps the headroom margin and cuts no more
        # answers than the truncation policy allows
        self.margin, self.policy = margin, policy
        self.counts: Counter[str] = Counter()
        self.best: tuple[float, int] | None = None
        self.bar: Any = None
        self.n_trials = 0
        self.retry = False  # hydra.sweeper.retry_failed_trials (the killed trials then run again)

    def refresh(self, study: optuna.Study) -> None:
        """Recount the finished trials (a retried one counts by its retry); running ones are counted as they go."""
        running = self.counts["running"]
        self.counts = Counter(running=running)
        best = None
        trials = study.get_trials(deepcopy=False)
        retried = retried_numbers(trials)
        for t in trials:
            if t.state not in FINISHED or t.number in retried:
                continue
            self.counts["finished"] += 1
            status = record.status(t.user_attrs)
            if status == "skipped":
                self.counts["skipped"] += 1
                self.counts[f"skipped_{t.user_attrs.get(record.SKIP_REASON, 'repeat')}"] += 1
            elif status == "ok":
                self.counts["ok"] += 1
                value = t.user_attrs.get(self.objective) if self._good(t.user_attrs) else None
                if value is not None and (best is None or (value > best[0]) == self.maximize):
                    best = (value, t.number)
            else:
                self.counts[f"failed_{failure_kind(t) or 'other'}"] += 1
                self.counts["failed"] += 1
                self.counts["killed_by_sweep"] += record.killed_by_sweep(t)
        self.best = best
        # the recipe's lever trials run beyond n_trials (src/sweep/recipe.py): the bar's total grows by them
        self.counts["levers"] = sum(1 for t in trials if record.LEVER in t.user_attrs)

    def _good(self, attrs: dict[str, Any]) -> bool:
        headroom, cut = attrs.get("vram_headroom_frac"), attrs.get("truncated_answer_frac")
        if headroom is not None and headroom < self.margin:
            return False
        return cut is None or self.policy is None or cut <= self.policy

    def total(self) -> int:
        """The trials the sweep runs: n_trials, and the recipe's lever trials beyond them."""
        return self.n_trials + self.counts["levers"]

    def start_bar(self, sweeper: DictConfig) -> None:
        from tqdm.auto import tqdm

        self.n_trials = int(sweeper.n_trials)
        self.retry = bool(sweeper.get("retry_failed_trials", False))
        self.bar = tqdm(
            total=self.total(),
            initial=min(self.counts["finished"], self.total()),
            desc=self.study_name,
            unit="trial",
            disable=not sweeper.progress,
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def show(self, finished: int = 0) -> None:
        """Advance the bar by `finished` trials and show the counts beside it."""
        if self.bar is None:
            return
        if self.bar.total != self.total():
            self.bar.total = self.total()
            self.bar.refresh()
        if finished:
            self.bar.update(finished)
        failed = " ".join(f"{k[7:]}={v}" for k, v in sorted(self.counts.items()) if k.startswith("failed_"))
        best = f" best={figure(self.best[0])} {self.objective} (#{self.best[1]})" if self.best else ""
        skipped = f" skipped={self.counts['skipped']}" if self.counts["skipped"] else ""
        self.bar.set_postfix_str(
            f"running={self.counts['running']} ok={self.counts['ok']}{skipped} {failed}{best}".strip()
        )

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary(
        self, storage_url: str, tracking_uri: str, trials_dir: Any, report: str, best: str | None = None
    ) -> str:
        """The sweep's closing lines; `best`: the line that names the best setting as the report reads it ("": none);
        None: the tally's (the best objective among the stable trials within the policies, as each trial read it)."""
        failed = ", ".join(f"{v} {k[7:]}" for k, v in sorted(self.counts.items()) if k.startswith("failed_"))
        lines = [
            f"\nstudy '{self.study_name}': {self.counts['finished']} trials finished, {self.counts['ok']} ok, "
            f"{self.skipped()}" + (f", failed: {failed}" if failed else "")
        ]
        if best is not None:
            lines += [best] if best else []
        elif self.best:
            lines.append(
                f"best stable {self.objective} within the policies: {figure(self.best[0])} (trial {self.best[1]})"
            )
        if self.counts["killed_by_sweep"] and not self.retry:
            lines.append(self.killed())
        lines.append(f"storage: {storage_url}  |  MLflow: {tracking_uri} (experiment '{self.study_name}')")
        lines.append(f"trial logs: {trials_dir}  |  map: {report}")
        return redact_text("\n".join(lines))

    def skipped(self) -> str:
        """ "4 skipped (3 certain OOMs, 1 repeat)": the skips by their reason (skip.reason)."""
        total = self.counts["skipped"]
        reasons = [(k[8:], v) for k, v in sorted(self.counts.items()) if k.startswith("skipped_") and v]
        words = ", ".join(f"{v} {_SKIP_WORDS.get(k, (k, k))[v != 1]}" for k, v in reasons)
        return f"{total} skipped" + (f" ({words})" if words else "")

    def killed(self) -> str:
        """What the trials the sweep itself killed (record.killed_by_sweep) count for, and how to run them again."""
        n = self.counts["killed_by_sweep"]
        return (
            f"{n} of them {'was' if n == 1 else 'were'} killed when a sweep stopped or its worker died (a kill -9, "
            "Ctrl-C), measuring nothing, yet counted toward n_trials: add hydra.sweeper.retry_failed_trials=true to "
            "the same command to queue them again and run them"
        )

    def complete(self, n_trials: int, report: str, fresh_name: str) -> str:
        """One line for a sweep run again on a study that already holds its `n_trials` finished trials (a killed
        trial among them: the key that runs it again; with the key on, the study was not complete)."""
        killed = f" {self.killed()}." if self.counts["killed_by_sweep"] else ""
        return redact_text(
            f"study '{self.study_name}' is already complete: it holds {self.counts['finished']} finished trials "
            f"(hydra.sweeper.n_trials={n_trials}), so no trial was run.{killed} Its map: {report}  |  to sweep again, "
            f"start a new study with hydra.sweeper.study_name={fresh_name}, or add trials to this one with "
            f"hydra.sweeper.n_trials={2 * n_trials}"
        )
