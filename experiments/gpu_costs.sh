#!/usr/bin/env bash
# Cost-model accuracy report and the per-layer figures on the GPU machine.
# Run from the repository root there; everything lands in $OUT (at most 8
# files: accuracy_<card>.md/.json (with XLA's after-fusion bytes per layer), figures_<card>.json, 5 PNGs when matplotlib
# is installed, else plot later with `layer_figures.py --data`). Budget: ~8 min
# on an H100/H200 host with 16 CPU cores.
#
#   OUT=/some/dir bash experiments/gpu_costs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-experiments/results}"
mkdir -p "$OUT"

# Setup as in DEVICE.md; pulp is only for the planner, so a missing wheel is fine.
# SKIP_INSTALL=1 when the caller installed already; SKIP_FIGURES=1 for the accuracy report alone.
if [ -z "${SKIP_INSTALL:-}" ]; then
  W=$(ls -d ../shared/wheels shared/wheels .whl 2>/dev/null | head -1 || true)
  if [ -n "$W" ]; then
    python3 -m pip install -q --no-index --find-links "$W" pulp || echo "pulp not installed (not needed here)"
  fi
  python3 -m pip install -q --no-build-isolation --no-deps -e .
fi
nvidia-smi --query-gpu=name,memory.total --format=csv || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices(), [d.device_kind for d in jax.devices()])"
python3 -c "import matplotlib" 2>/dev/null || echo "no matplotlib here: figures_*.json only"

# Measurements are cached here: the figures reuse the accuracy run's GPU layers.
export HETPAR_CACHE_DIR=/tmp/hetpar_cache
# Cheap models first, so the time budget drops the biggest ones if anything.
MODELS="${MODELS:-mlp,lm_embed,conv6,rnn,cnn_preprocess,mobilenet_v1,resnet18,transformer,alexnet,cyclegan_generator,resnet50,vgg16}"
TAG="${TAG:-}"
BUDGET="${BUDGET:-150}"
ACC_TIMEOUT="${ACC_TIMEOUT:-300}"

start=$(date +%s)
timeout "$ACC_TIMEOUT" python3 experiments/cost_accuracy.py --out_dir "$OUT" --models "$MODELS" \
  --budget_s "$BUDGET" --k 10 ${TAG:+--tag "$TAG"} 2>&1 | grep -vE "^I.* (on (cpu|gpu):0): " || echo "accuracy run failed or timed out"
echo "accuracy took $(( $(date +%s) - start )) s"
if [ -n "${SKIP_FIGURES:-}" ]; then ls -la "$OUT"; exit 0; fi
start=$(date +%s)
timeout 200 python3 experiments/layer_figures.py --out_dir "$OUT" --k 5 2>&1 | tail -20 \
  || echo "figures run failed or timed out"
echo "figures took $(( $(date +%s) - start )) s"
ls -la "$OUT"
