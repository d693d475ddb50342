#!/usr/bin/env bash
# On a lent GPU machine (PyTorch and CUDA, no network), from the repository's root, with .whl/
# carried (`make gpu-wheels` here first): the GPU bench and --check's GPU step, about 9 minutes
# on an H200 (docs/gpu.md). Output: the terminal, and $OUT (gpu_actor.txt, gpu_actor.json, log.txt).
#   bash bench/gpu_device.sh [bench/gpu_actor.py arguments]   (default: --smoke --turns 30 --budget-s 415)
set -uo pipefail
# Inside the repository's git-ignored .cache/, as on this machine.
SITE=$PWD/.cache/gpu-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 CUA_RL_CACHE=$PWD/.cache
OUT=${OUT:-runs/gpu-actor}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--smoke --turns 30 --budget-s 415)
timeout 530 python3 bench/gpu_actor.py "${args[@]}" 2>&1 | tee "$OUT/log.txt" |
  grep -vE "INFO|Warning|warn|sliced_mesh|^\s*$"
