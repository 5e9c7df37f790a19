# The README's commands.  `make demo` and `make test` set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ulfmtrain-installed

.PHONY: setup demo test test-long test-slurm bench clean

setup: $(STAMP)

$(STAMP): scripts/install.sh pyproject.toml meson.build setup.py VERSION csrc/* ulfmtrain/* ulfmtrain/*/*
	VENV=$(VENV) scripts/install.sh
	touch $@

demo: setup
	$(PY) -P -m ulfmtrain demo

test: setup
	$(PY) -P -m pytest --durations=15

test-long: setup
	$(PY) -P -m pytest -m long

# Jobs under a real Slurm on network-namespace hosts (tests/slurm): installs Slurm where it can (apt-get as root),
# else the tests skip with the reason.
test-slurm: setup
	scripts/install_slurm.sh
	$(PY) -P -m pytest -m slurm --durations=10 tests/slurm

bench: setup
	$(PY) -P benchmarks/run_all.py

clean:
	rm -rf build .mesonpy-* ulfmtrain-out ulfmtrain-demo
