# Two commands on a fresh machine: `make run` (the embedded CPU default job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines take the local CPU wheel; on a GPU cluster install your CUDA build of torch first
# and call `make install TORCH_SPEC=`.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)

.PHONY: install run test clean

$(STAMP): setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: $(STAMP)

# SFT warm-up + e2e-TV MTP heads (train-mtp), then async GRPO with speculative rollouts (rl)
run: $(STAMP)
	$(BIN)/bebop train-mtp --config configs/tiny_cpu.yaml
	$(BIN)/bebop rl --config configs/tiny_cpu.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf outputs .pytest_cache
