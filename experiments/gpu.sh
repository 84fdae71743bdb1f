#!/usr/bin/env bash
# One driver for every experiment that needs the GPU machine.
#
#   OUT=/some/dir bash experiments/gpu.sh JOB [ARGS...]
#   bash experiments/gpu.sh help            # the job list
#
# Run it from anywhere; it works in the repository root. experiments/README.md
# ("Running them") says how it sets up (SKIP_SETUP=1 skips it), where results go
# ($OUT, named after the card: h200, h100, h200x2, ...) and what each job measures.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: OUT=DIR bash experiments/gpu.sh JOB [ARGS...]

one GPU (the card and its host CPU):
  profile [FLAGS]     hetpar profile (FLAGS e.g. --quick) + predictor check + cost-model tests
  costs               cost-model accuracy report and the per-layer figures
                      (env: MODELS, TAG, BUDGET=150, ACC_TIMEOUT=300, SKIP_FIGURES=1)
  runtime             GPU tests, runtime benchmark (overhead, overlap, transfers), Figure 2 on GPU
  baselines           hetpar against its baselines
                      (env: MODELS, TAG, MEMORY=transformer, PROFILES, BUDGET=560)
  rows                VGG16 baselines row; lm_embed, cnn_preprocess with spec-sheet links
  cross-card          plan for elsewhere (issue 17): hetpar profile --fit, every zoo model's
                      step (cross_card.py measure), every layer on the GPU (cost_accuracy.py)
                      (env: FIT=default, SKIP_LAYERS=1, BUDGET=170; more than one call's 600 s)
  fit-check [FLAGS]   issue 17: hetpar profile --fit default [FLAGS], then the file checked on
                      held-out zoo models' layers (check_fitted_profile.py; env FIT_TIMEOUT,
                      CHECK_TIMEOUT, CHECK_DEVICES=cpu:0: check only those)
  hetpar ARGS...      any hetpar command, e.g. `hetpar run resnet18 --steps 8`
                      (output in run_resnet18_<card>.txt)

two GPUs (env PROFILES: the profile file, default results/profile_2gpu_h200x2.json):
  two-gpus            the built-in two-GPU sweep
  two-gpus-planned    transformer batch 256: the planner's pipelines M = 4, 8 (1F1B)
  two-gpus-launch     are microbatched pipelines launch-bound? (floor rows)
  two-gpus-replay     transformer b256 M = 1..8, and the memory case, replayed predictions
  two-gpus-study      VGG16 (b128) and AlexNet (b512), M = 1..16, GPipe and 1F1B
  two-gpus-measured   VGG16 and transformer with layer shares measured on the GPU
  two-gpus-final      transformer b256, final calibration (env PROFILES_PEER: the peer-link profile)
  predictions [PLANS] predicted against measured under hetpar.auto, spec sheets and
                      profile='measure' (bench_predictions.py; PLANS: names or parts of
                      names, default all; env BATCH=256, MEMORY_FRACTION=0.7,
                      OFFLOAD_FRACTION=0.5, BUDGET=560,
                      PROFILE_KINDS="auto measure", ANCHORS=1: time a pipeline's anchors)
  fit-two-gpus [FRACTIONS]
                      issue 41's two-GPU cells: the GPU tests at full f32 (SKIP_TESTS=1
                      skips them), then bench_fit --gpus 2 on MODELS (default llama7b:
                      the 6.74B Llama-style model) at FRACTIONS (default "default,0.3"),
                      MODES (default hetpar; jit,hetpar adds FSDP written by hand),
                      FIT_TIMEOUT s a cell (default 300; results/fit_h200x2/README.md,
                      "Not run")
  sweep MODEL BATCH MICROBATCHES BUDGET_S NAME [FLAGS]
                      one model's sweep of the planner's pipelines (bench_two_gpus.py)
EOF
}

card() {  # h200, h100, h200x2, ...; cpu when there is no GPU
  local names n kind
  names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)
  n=$(printf '%s\n' "$names" | grep -c .)
  [ "$n" -eq 0 ] && { echo cpu; return; }
  kind=$(printf '%s\n' "$names" | head -1 | grep -oiE 'h100|h200|a100|l4|t4' | head -1 \
    | tr '[:upper:]' '[:lower:]')
  kind=${kind:-gpu}
  [ "$n" -gt 1 ] && kind="${kind}x${n}"
  echo "$kind"
}

setup() {
  local marker=/tmp/hetpar_gpu_setup.done W
  if [ -n "${SKIP_SETUP:-}" ] || [ -e "$marker" ]; then return; fi
  W=${HETPAR_WHEELS:-$(ls -d shared/wheels ../shared/wheels .whl 2>/dev/null | head -1 || true)}
  if [ -n "$W" ]; then
    python3 -m pip install -q --no-index --find-links "$W" pulp highspy \
      || echo "warning: pulp/highspy not installed from $W (the planner needs pulp)"
    # transformers 4.x for the Hugging Face Flax models (the machine's 5.x has
    # none); its other requirements are the machine's own.
    if ls "$W"/hf/transformers-4*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps "$W"/hf/*.whl \
        || echo "warning: transformers 4.x not installed from $W/hf"
    fi
  else
    echo "warning: no wheel folder (HETPAR_WHEELS, shared/wheels, ../shared/wheels, .whl):" \
         "pulp not installed; profile and costs still run"
  fi
  python3 -m pip install -q --no-build-isolation --no-deps -e . || {
    echo "error: pip install -e . failed"; exit 1; }
  touch "$marker"
}

describe() {  # the machine, into the log: every figure names its card
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv || true
  lscpu | grep -E "Model name|^CPU\(s\)" || true
  python3 -c "import jax; print('jax', jax.__version__, jax.devices(), jax.devices('cpu'))"
}

quiet() { grep -v "^I1\|^W1"; }  # absl INFO/WARNING lines

# One model's sweep of the planner's pipelines over M and schedules, beside one
# GPU's jax.jit and data parallelism, with replayed predictions.
sweep() {  # MODEL BATCH MICROBATCHES BUDGET_S NAME [FLAGS...]
  local model=$1 batch=$2 mbs=$3 budget=$4 name=$5
  shift 5
  (cd experiments && timeout $((budget + 90)) python3 bench_two_gpus.py --out "$OUT/${name}_$CARD" \
    --budget_s "$budget" --steps 10 --model "$model" --batch "$batch" --microbatches "$mbs" \
    --schedules gpipe,1f1b --nohalf --profiles "$PROFILES" "$@" 2>&1 \
    | quiet | grep "^| [a-z]\|^calibrated\|Error\|error" | cut -c1-300)
}

job=${1:-help}
[ $# -gt 0 ] && shift
case "$job" in
help|-h|--help) usage; exit 0 ;;
profile|costs|cross-card|runtime|baselines|rows|fit-check|hetpar) TWO_GPUS= ;;
two-gpus|two-gpus-planned|two-gpus-launch|two-gpus-replay|two-gpus-study|two-gpus-measured|\
two-gpus-final|sweep|predictions|fit-two-gpus) TWO_GPUS=1 ;;
*) echo "unknown job: $job"; usage; exit 2 ;;
esac
if [ "$job" = sweep ] && [ $# -lt 5 ]; then
  echo "usage: gpu.sh sweep MODEL BATCH MICROBATCHES BUDGET_S NAME [FLAGS]"; exit 2
fi

if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d /tmp/hetpar_gpu.XXXXXX)
  echo "results go to $OUT (set OUT to choose)"
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: several jobs run from experiments/
export OUT PYTHONUNBUFFERED=1
# Huge pages for malloc, as the `hetpar` command sets for itself: a CPU layer's
# temporaries in 4 KiB pages cost it 15-25% and stalled the process 40-80 ms
# after it (results/cpu_stall). HETPAR_NO_HUGE_PAGES=1 runs as before.
# A hugetlb value the caller names is kept, other tunables joined.
if [ -z "${HETPAR_NO_HUGE_PAGES+set}" ]; then
  case ":${GLIBC_TUNABLES:-}:" in
    *:glibc.malloc.hugetlb=*) ;;
    *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
  esac
fi

setup
CARD=${CARD:-$(card)}
# Profile files are named relative to experiments/ (the jobs run there).
if [ -n "$TWO_GPUS" ]; then
  PROFILES=${PROFILES:-results/profile_2gpu_h200x2.json}
else
  PROFILES=${PROFILES-}
fi
echo "== $job on $CARD ($(date -u +%Y-%m-%dT%H:%MZ)), results in $OUT"
describe
start=$(date +%s)

case "$job" in
profile)
  # Profile the devices present (full sizes unless FLAGS say --quick), then what
  # the predictor says with those profiles; profile_gpu_<card>.{json,log}.
  {
    echo "== card"
    describe
    echo "== hetpar profile"
    t0=$(date +%s)
    python3 -m hetpar profile --out "$OUT/profile_gpu_$CARD.json" "$@"
    echo "profile took $(( $(date +%s) - t0 )) s"
    echo "== what the predictor says with these profiles (f32, 4096^3 matmul and 256 MB elementwise)"
    python3 - "$OUT/profile_gpu_$CARD.json" <<'PY'
import sys
from hetpar.cost_models import LayerWork, load_profiles, predict
ps = load_profiles(sys.argv[1])
mm = LayerWork({"matmul": 2 * 4096**3}, {"matmul": 3 * 4096**2 * 4})
ew = LayerWork({"elementwise": 2 * 2**26}, {"elementwise": 2 * 2**28})
for name in [n for n, p in ps.devices.items() if p.origin == "measured"] + ["h100", "h200", "a100", "cpu"]:
    p = ps.device(name)
    print(f"{name:8s} {p.origin:11s} matmul {predict(p, mm) * 1e3:8.3f} ms   elementwise {predict(p, ew) * 1e3:8.3f} ms")
for lk in ps.links:
    print(f"{lk.src} -> {lk.dst} {lk.path:20s} 256 MB in {lk.time(2**28) * 1e3:8.2f} ms")
PY
    if python3 -c "import pytest" 2>/dev/null; then
      echo "== cost-model tests"
      python3 -m pytest -q -p no:cacheprovider tests/test_cost_models.py || true
    fi
  } 2>&1 | tee "$OUT/profile_gpu_$CARD.log"
  ;;
costs)
  # Cost-model accuracy (accuracy_<card>.md/.json, with XLA's after-fusion bytes
  # per layer), then the per-layer figures (figures_<card>.json, 5 PNGs when
  # matplotlib is installed; else plot later with `layer_figures.py --data`).
  python3 -c "import matplotlib" 2>/dev/null || echo "no matplotlib here: figures_*.json only"
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache  # the figures reuse the accuracy run's GPU layers
  # Cheap models first, so the time budget drops the biggest ones if anything.
  MODELS="${MODELS:-mlp,lm_embed,conv6,rnn,cnn_preprocess,mobilenet_v1,resnet18,transformer,alexnet,cyclegan_generator,resnet50,vgg16}"
  TAG="${TAG:-}"
  timeout "${ACC_TIMEOUT:-300}" python3 experiments/cost_accuracy.py --out_dir "$OUT" \
    --models "$MODELS" --budget_s "${BUDGET:-150}" ${TAG:+--tag "$TAG"} 2>&1 \
    | grep -vE "^I.* (on (cpu|gpu):0): " || echo "accuracy run failed or timed out"
  echo "accuracy took $(( $(date +%s) - start )) s"
  if [ -z "${SKIP_FIGURES:-}" ]; then
    t0=$(date +%s)
    timeout 200 python3 experiments/layer_figures.py --out_dir "$OUT" --k 5 2>&1 | tail -20 \
      || echo "figures run failed or timed out"
    echo "figures took $(( $(date +%s) - t0 )) s"
  fi
  ;;
cross-card)
  # This card's side of experiments/cross_card.py: its profile, every model's
  # whole step with what it predicts for the other GPU kinds, every layer timed
  # alone. `cross_card.py compare` then sets two cards' runs side by side.
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache
  timeout 420 python3 -m hetpar profile --devices gpu:0 --no-transfers --fit "${FIT:-default}" \
    --out "$OUT/profile_gpu_$CARD.json" 2>&1 | grep -v " on gpu:0: " | tail -3
  timeout 280 python3 experiments/cross_card.py measure --profiles "$OUT/profile_gpu_$CARD.json" \
    --out "$OUT" 2>&1 | quiet
  echo "steps took $(( $(date +%s) - start )) s"
  if [ -z "${SKIP_LAYERS:-}" ]; then
    MODELS="${MODELS:-mlp,lm_embed,conv6,rnn,cnn_preprocess,mobilenet_v1,resnet18,transformer,alexnet,cyclegan_generator,resnet50,vgg16}"
    timeout "${ACC_TIMEOUT:-260}" python3 experiments/cost_accuracy.py --out_dir "$OUT" \
      --platforms gpu --models "$MODELS" --budget_s "${BUDGET:-170}" --tag "gpu_$CARD" \
      2>&1 | grep -vE "^I.* on gpu:0: " | tail -25 || echo "accuracy run failed or timed out"
  fi
  ;;
runtime)
  python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests_$CARD.log" | tail -5
  python3 experiments/bench_runtime.py --out "$OUT/runtime_$CARD" 2>&1 | grep -v "^I1" | tail -40
  python3 experiments/figure2_hlo_profiles.py --backend gpu --out "$OUT/figure2_gpu_$CARD" 2>&1 \
    | grep "^|"
  ;;
baselines)
  # hetpar against its baselines for the zoo models in $MODELS (default: all but
  # resnet50 and vgg16, which a second call runs: MODELS=resnet50,vgg16 TAG=_big MEMORY="").
  cd experiments
  MODELS=${MODELS:-lm_embed,mlp,rnn,cnn_preprocess,conv6,mobilenet_v1,resnet18,alexnet,cyclegan_generator,transformer}
  name="baselines_$CARD${TAG:-}"
  timeout $(( ${BUDGET:-560} - ($(date +%s) - start) )) python3 bench_baselines.py \
    --out "$OUT/$name" --models "$MODELS" --memory_model "${MEMORY-transformer}" \
    ${PROFILES:+--profiles $PROFILES} 2>&1 | quiet > "$OUT/$name.log"
  grep -A12 "^## Goals" "$OUT/$name.md"
  ;;
rows)
  # The VGG16 row, and lm_embed/cnn_preprocess under the spec sheets' link latency
  # (no --profiles: what hetpar.auto sees by default).
  cd experiments
  timeout 330 python3 bench_baselines.py --out "$OUT/baselines_${CARD}_vgg16" --models vgg16 \
    --memory_model "" --profiles "${PROFILES:-results/profile_gpu_h200.json}" 2>&1 | tail -3
  timeout 150 python3 bench_baselines.py --out "$OUT/baselines_${CARD}_spec_latency" \
    --models lm_embed,cnn_preprocess --memory_model "" 2>&1 | tail -3
  ;;
fit-check)
  # Issue 17 as a user gets it: `hetpar profile --fit default` on this machine, then
  # the fitted file checked on held-out zoo models' layers (check_fitted_profile.py).
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache
  {
    t0=$(date +%s)
    timeout "${FIT_TIMEOUT:-330}" python3 -m hetpar profile --fit default \
      --out "$OUT/profile_fit_$CARD.json" "$@"
    echo "profile --fit took $(( $(date +%s) - t0 )) s"
    t0=$(date +%s)
    timeout "${CHECK_TIMEOUT:-200}" python3 experiments/check_fitted_profile.py \
      --profiles "$OUT/profile_fit_$CARD.json" --out "$OUT/check_$CARD" \
      ${CHECK_DEVICES:+--devices "$CHECK_DEVICES"}
    echo "check took $(( $(date +%s) - t0 )) s"
    # The layer timings behind the fit, so it can be refitted offline.
    tar czf "$OUT/hetpar_cache_$CARD.tgz" -C /tmp hetpar_cache 2>/dev/null
  } 2>&1 | quiet | tee "$OUT/fit_check_$CARD.log"
  ;;
predictions)
  # Issue 17's table: every plan (or those named) predicted and measured, as a user runs it.
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache  # layers measured once across calls on this machine
  plans=()
  [ $# -gt 0 ] && plans=(--plans "$@")
  (cd experiments && timeout "${BUDGET:-560}" python3 bench_predictions.py \
    --out "$OUT/predictions_${CARD}_b${BATCH:-256}" --batch "${BATCH:-256}" \
    --memory_fraction "${MEMORY_FRACTION:-0.7}" --offload_fraction "${OFFLOAD_FRACTION:-0.5}" --profiles ${PROFILE_KINDS:-auto measure} \
    ${ANCHORS:+--anchors} "${plans[@]}" 2>&1 | grep "predicted\|failed\|anchors")
  ;;
hetpar)
  # Named after the sub-command and its first argument: `hetpar run resnet18`
  # writes run_resnet18_<card>.txt.
  name=$(printf '%s\n' "${@:1:2}" | grep -v '^-' | paste -sd_ - | tr -c 'A-Za-z0-9_.\n-' '_')
  python3 -m hetpar "$@" 2>&1 | tee "$OUT/${name:-hetpar}_$CARD.txt"
  ;;
two-gpus)
  # Two GPUs against one.
  (cd experiments
   timeout 400 python3 bench_two_gpus.py --out "$OUT/two_gpus_$CARD" --budget_s 330 \
     --profiles "$PROFILES" 2>&1 | quiet | tail -30)
  ;;
two-gpus-planned)
  # The planner's pipelines (M = 4, 8, 1F1B) beside one GPU, data parallel and
  # the planner's own choice.
  sweep transformer 256 4,8 270 two_gpus_transformer_b256_planned --schedules 1f1b
  ;;
two-gpus-launch)
  # Is the microbatched pipeline launch-bound? Each run adds "one GPU, whole
  # step at batch/M, xM" beside hetpar's M-microbatch pipeline.
  run() {  # name budget args...
    local name=$1 budget=$2; shift 2
    (cd experiments && timeout $((budget + 45)) python3 bench_two_gpus.py \
      --out "$OUT/${name}_$CARD" --budget_s "$budget" --steps 10 --noplanner "$@" 2>&1 \
      | grep "^| [a-z]")
  }
  run two_gpus_transformer_b32_m16 45 --model transformer --batch 32 --microbatches 16 \
    --schedules gpipe
  run two_gpus_alexnet_b128 45 --model alexnet --batch 128 --microbatches 1,4 --schedules gpipe
  run two_gpus_transformer_b128 60 --model transformer --batch 128 --microbatches 1,4 \
    --schedules gpipe,1f1b
  ;;
fit-two-gpus)
  export HETPAR_CACHE_DIR=${HETPAR_CACHE_DIR:-/tmp/hetpar_cache}
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 230 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests_$CARD.txt" | tail -4
  fi
  python3 experiments/bench_fit.py --gpus 2 --models "${MODELS:-llama7b}" \
    --fractions "${1:-default,0.3}" --modes "${MODES:-hetpar}" --timeout "${FIT_TIMEOUT:-300}" --steps 6 \
    --timeline "$OUT/tl" --out "$OUT/fit_two_gpus_$CARD.json" 2>&1 | tail -4
  ;;
two-gpus-replay)
  sweep transformer 256 1,2,4,8 330 two_gpus_transformer_b256_replay
  sweep transformer 16 4 120 two_gpus_transformer_memory_replay --memory_only \
    --memory_fraction 0.6
  ;;
two-gpus-study)
  sweep vgg16 128 1,2,4,8,16 260 two_gpus_vgg16_b128
  sweep alexnet 512 1,2,4,8,16 130 two_gpus_alexnet_b512
  ;;
two-gpus-measured)
  # Layer shares timed on gpu:0 (`cost_table(measure=True)`) instead of the
  # spec sheets' roofline; the fixed part from gradient-only steps.
  sweep vgg16 128 1,2,4,8,16 220 two_gpus_vgg16_b128_measured
  sweep transformer 256 2,4,8 170 two_gpus_transformer_b256_measured \
    --schedules 1f1b
  ;;
two-gpus-final)
  # Fixed part from gradient-only steps, the peer link measured at pipeline sizes
  # (profile_2gpu_h200x2_peer.json); M = 2, 4, 8 (1F1B).
  PROFILES=${PROFILES_PEER:-results/profile_2gpu_h200x2_peer.json}
  sweep transformer 256 2,4,8 150 two_gpus_transformer_b256_final --schedules 1f1b --nochoice
  ;;
sweep)
  sweep "$@"
  ;;
esac
echo "== $job took $(( $(date +%s) - start )) s; in $OUT:"
ls -la "$OUT"
