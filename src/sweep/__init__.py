"""The sweep engine behind `hydra/sweeper=optuna` (`engine.SweepEngine`): Optuna asks, each trial runs in a fresh
process on a slot of its own, the outcome (or the way the process died) is classified and told back, MLflow
records it all. Nothing is imported here: the forkserver preloads `src.sweep.warm` without the engine.

- `space`: the search space from hydra-optuna-sweeper's grammar; `slots`: where trials run;
- `process`: one trial's process, watched (`launcher`, `warm`: how it starts);
- `storage`: the study, the lock every worker takes to ask, recovery of trials whose worker died;
- `runs`: the sweep's MLflow runs; `rules`: what is not launched and how a failure is told to Optuna;
- `tally`: counts, progress bar, summary; `stop`: how a sweep stops early (signals, a full disk); `engine`: the loop.
"""
