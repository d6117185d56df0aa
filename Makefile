# Two commands for a newcomer on a fresh machine (no venv, no TensorFlow):
#   make demo   trains the digits example (checkpoints + TensorBoard events in runs/digits)
#   make test   runs the test suite
# and `make docs` builds the documentation site into site/ (mkdocs build --strict).
# Each creates .venv and installs what it needs on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo fit multiworker test fuzz lint bench faults docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,dev,docs]"
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(PY) examples/digits.py --logdir runs/digits

fit: $(STAMP)
	$(PY) examples/fit.py --logdir runs/fit

multiworker: $(STAMP)
	$(PY) examples/multiworker.py --workers 2 --logdir runs/multiworker

# Six workers on two cores: about half of the suite waits (on subprocesses, on a grace, on
# a heartbeat), and a waiting worker leaves its core to another. The workers are forked
# from one fork server (TensorFlow imported once for the run), which forks their training
# children too. The longest tests are dealt out first, a share to each worker
# (tests/conftest.py), and idle workers steal from busy ones, so that no long test starts
# when the others are done.
test: $(STAMP)
	$(PY) -m pytest -q -n 6 --dist worksteal --durations=15

# The model-based searches, long: hundreds of random sequences in process, across real
# processes and over the history, and interrupted runs against the run left alone (the
# suite gives each a few seconds). The seed is printed first and last: ASV_SEED=<n>
# runs the same sequences again; ASV_FUZZ_SECS=<s> sets each search's length.
fuzz: $(STAMP)
	ASV_FUZZ=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_model_based.py tests/test_model_based_processes.py tests/test_history.py tests/test_resume_equivalence.py

# Every benchmark the docs show a table of (docs/_hooks/measured.py names them), then
# their tables written into the pages. Long: peers, multiworker and goodput take a while;
# run them on a quiet machine.
bench: $(STAMP)
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/step_overhead.py --health-only
	$(PY) benchmarks/checkpoint_stall.py
	$(PY) benchmarks/commit_cost.py
	$(PY) benchmarks/commit_cost.py --commits 30000 --results commit_cost_30000
	$(PY) benchmarks/lifecycle_latency.py
	$(PY) benchmarks/restart_latency.py
	$(PY) benchmarks/fork_exit.py
	$(PY) benchmarks/close_stall.py
	$(PY) benchmarks/fit_overhead.py
	$(PY) benchmarks/fit_interruptions.py --trials 5
	$(PY) benchmarks/multiworker.py
	$(PY) benchmarks/object_store.py
	$(PY) benchmarks/evaluation_hold.py
	$(PY) benchmarks/goodput.py
	$(PY) benchmarks/goodput.py --slurm --steps 4000 --save-steps 100
	$(PY) benchmarks/goodput.py --store gcs --local-tier
	$(PY) benchmarks/resume_cost.py
	$(PY) benchmarks/resume_equivalence.py
	$(PY) benchmarks/resume_equivalence.py --workers
	$(PY) docs/_hooks/measured.py

# The fault report of docs/shutdowns.md: SIGKILLs at random moments and every fault, on
# real processes (5 to 10 minutes), then its table written into the page.
faults: $(STAMP)
	$(PY) tests/faults/run_report.py
	$(PY) docs/_hooks/measured.py

# The documentation site; any warning (a broken link, a docstring that does not render,
# a benchmark table that cannot be written) fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# lint: the benchmarks are type-checked too, whose figures the docs publish (one broke
# unseen when a helper it calls changed): strict but for what TensorFlow's untyped API
# makes noise of.
lint: $(STAMP)
	$(VENV)/bin/ruff check asupervisor services tests examples benchmarks docs/_hooks
	$(VENV)/bin/ruff format --check asupervisor services tests examples benchmarks docs/_hooks
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --allow-subclassing-any --allow-untyped-decorators --no-warn-return-any \
		benchmarks/*.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .mypy_cache .ruff_cache
