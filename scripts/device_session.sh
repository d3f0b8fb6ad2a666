#!/usr/bin/env bash
# A device call's whole command (the device tool's `run`, with carry [".whl"] after
# scripts/gpu_wheels.sh here):
#   bash scripts/device_session.sh --budget-s 540 --only tests,qwen3,steps,profile,fp8
# Installs the carried wheels, prints the card and the library versions, runs
# benchmarks/gpu_throughput.py with the given arguments (under a timeout that leaves time
# to copy its results), and puts its log and results in $OUT (the files that come back).
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
out=${OUT:-gpu_results}
mkdir -p "$out" /tmp/gpu_results
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${DEVICE_TIMEOUT_S:-570}" python3 benchmarks/gpu_throughput.py --output-dir /tmp/gpu_results "$@" 2>&1 \
  | tee "$out/log.txt"
cp /tmp/gpu_results/*.json /tmp/gpu_results/*.log /tmp/gpu_results/*.txt "$out/" 2>/dev/null
exit 0
