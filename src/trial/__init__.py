"""One trial: `run` in this process (single.py), or `run_data_parallel` with one `run_rank` process per card
(data_parallel.py); both hold a `TrialContext` and open and describe their run alike (context.py). src/handoff.py
names what a trial and the sweep engine tell each other."""

from src.trial.attempts import run_attempt
from src.trial.data_parallel import run_data_parallel, run_rank
from src.trial.single import run
from src.trial.supervised import supervise

__all__ = ["run", "run_attempt", "run_data_parallel", "run_rank", "supervise"]
