# make demo : fresh CPU machine -> .venv, install, a real Optuna sweep of the tiny Llama, the stability report
# make test : the whole test suite (lint included); .ci/run calls exactly this
# make ui   : MLflow UI over mlruns/ on 127.0.0.1 (holds the terminal until Ctrl-C)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PORT   ?= 5000
STUDY  ?= demo

.PHONY: demo test ui lint clean

# The CPU build of torch that lies on disk (the `cpu` extra pins it), never a multi-GB CUDA build. Where the
# package index would serve the CUDA build (plain PyPI on Linux): make TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Where pip is told where that build lies (find-links, in its environment or config), uv installs the same packages
# (the same 137 at the same versions as pip, checked on this machine) in ~40 s instead of pip's ~150 s; uv reads no
# pip.conf, so the find-links are passed on. Without them, or if uv fails, pip installs as before. Bytecode is
# compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine) nothing writes it later, and
# every trial process would compile torch's and transformers' imports again (the suite took 16:51 instead of 9:17).
FIND_LINKS := $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\([^']*\)'$$/\1/p" | head -1)
PIP_ARGS   := -e '.[cpu,dev]' --config-settings editable_mode=compat
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if [ -n "$(FIND_LINKS)" ] && $(PY) -m pip install -q 'uv>=0.9'; then \
		$(PY) -m uv pip install -q --compile-bytecode --python $(PY) $(PIP_ARGS) $(foreach f,$(FIND_LINKS),--find-links $(f)) \
			$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match) \
		|| $(PY) -m pip install -q $(PIP_ARGS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)); \
	else $(PY) -m pip install -q $(PIP_ARGS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)); fi
	touch $@

# The whole way, as a user takes it: the map and the soak of its best setting (one sweep), the map, the promotion
# of the soaked setting (no flags), and a production trial of it (bounded to DEMO_STEPS steps: its 5 epochs would
# take minutes on a CPU; the file it trains is the promoted one, unchanged).
DEMO_STEPS ?= 30
demo: $(VENV)/.installed
	$(PY) -m src.train -m hydra/sweeper=optuna sweep=demo hydra.sweeper.study_name=$(STUDY)
	$(PY) -m src.report $(STUDY)
	$(PY) -m src.promote $(STUDY)
	$(PY) -m src.train experiment=production trainer.max_steps=$(DEMO_STEPS)
	@echo
	@echo "The map, the soak and the recommendation: sweeps/$(STUDY)/report.md (and its soak's log: sweeps/$(STUDY)/soak/)"
	@echo "The promoted setting:  conf/experiment/production.yaml, and the MLflow registry's 'production' alias"
	@echo "Its production run:    sweeps/runs/<model>-<settings>/ (checkpoints, adapter/, run.json), MLflow experiment 'qlora-trials'"
	@echo "Trials, metrics, soak: make ui  (MLflow at http://127.0.0.1:$(PORT), experiment '$(STUDY)')"
	@echo "Everything else, in the venv: . $(VENV)/bin/activate   then python -m src.train, python -m src.report $(STUDY), ..."
	@echo "Again: study '$(STUDY)' is complete: it is reported, its promotion found unchanged, its production run found finished; a fresh one: make demo STUDY=$(STUDY)-2 (as the sweep suggests)"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src hydra_plugins tests benchmarks
	$(VENV)/bin/ruff format --check src hydra_plugins tests benchmarks

test: $(VENV)/.installed lint
	$(PY) -m pytest -n 2 --dist loadgroup -v --durations=15

ui: $(VENV)/.installed
# Holds the terminal until Ctrl-C. One uvicorn worker and no job runner (its huey consumers run GenAI jobs this
# project never starts): two processes (mlflow and its worker), ~0.5 GiB of RAM instead of ~3 GiB in 16; no access
# log (a line per HTTP request). The report: the sweep's parent run, Artifacts, report/report.html.
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db \
		--host 127.0.0.1 --port $(PORT) --workers 1 --uvicorn-opts "--no-access-log"

clean:
	rm -rf sweeps/* mlruns/* .cache
	touch sweeps/.gitkeep mlruns/.gitkeep
