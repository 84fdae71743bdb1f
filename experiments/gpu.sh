#!/usr/bin/env bash
# One driver for every experiment that needs the GPU machine.
#
#   OUT=/some/dir bash experiments/gpu.sh JOB [ARGS...]
#   bash experiments/gpu.sh help            # the job list
#
# Run it from anywhere; it works in the repository root. The GPU machine has
# no package index, so setup installs pulp and highspy from a wheel folder
# (first found: $HETPAR_WHEELS, shared/wheels, ../shared/wheels, .whl), then
# hetpar itself in editable mode without dependencies (jax, flax, optax,
# networkx, numpy, absl-py are in the machine's image). Setup runs once per
# machine; SKIP_SETUP=1 skips it. Results go to $OUT (default: a fresh folder
# under /tmp, printed), named after the card ($CARD: h200, h100, h200x2, ...,
# read from nvidia-smi). experiments/README.md lists what each job measures
# and the result it last committed.
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
  baselines           hand-off probe, then hetpar against its baselines
                      (env: MODELS, TAG, MEMORY=transformer, PROFILES, BUDGET=560)
  launch              fixed cost per step under XLA command-buffer flags; overhead probe
  overhead            overhead probe (hetpar vs jax.jit, interleaved); VGG16 baselines row
  rows                VGG16 baselines row; lm_embed, cnn_preprocess with spec-sheet links
  dispatch            does a jitted GPU call block its caller? (probe_dispatch.py)
  cross-card          plan for elsewhere (issue 17): hetpar profile --fit, every zoo model's
                      step (cross_card.py measure), every layer on the GPU (cost_accuracy.py)
                      (env: FIT=default, SKIP_LAYERS=1, BUDGET=170; more than one call's 600 s)
  layer-sweep         issue 17: time the synthetic layer sweep (layer_sweep.py) on the GPU and
                      its host CPU, then fit on it and test on every zoo model's saved layers
                      (env SWEEP_TIMEOUT=420)
  plan-memory         issue 17: GPT-2 b16 planned with the GPU capped (FRACTIONS="0.25 0.1"), then
                      each plan and jax.jit run in fresh processes: the GPU's real peak bytes
                      (env RUN_FLAGS="--stages --watch" for the plan's run, PREFETCHES="1 3":
                      runs again with Executor.PREFETCH set, NO_JIT=1: no jax.jit run,
                      SAVE_CACHE=1: the timed layers' cache entries as layer_cache.tgz)
  profile-links       issue 17: hetpar profile, then its link curves against the engine's
                      copies between its samples (profile_links.py; env PROFILE_TIMEOUT=300)
  links               issue 17: the transfer engine's copies GPU <-> CPU device and pinned
                      host memory at 1-256 MB, and link_bandwidth's slope (probe_links.py)
  fit-check [FLAGS]   issue 17: hetpar profile --fit default [FLAGS], then the file checked on
                      held-out zoo models' layers (check_fitted_profile.py; env FIT_TIMEOUT,
                      CHECK_TIMEOUT, REFIT=cpu:0: also refit that device on its fit layers
                      timed again after the check, and score again; CHECK_DEVICES=cpu:0:
                      check only those)
  cpu-timing          issue 17: how repeatably the host CPU times the fit and held-out layers,
                      blocked (hetpar's protocol) vs interleaved vs recompiled, and the layer
                      model's error under each (probe_cpu_timing.py; env TIMING_TIMEOUT=540,
                      TIMING_FLAGS="--protocols interleaved --small_sweep")
  cpu-reference       issue 17: the host CPU's layer model fitted and checked on the zoo's
                      reference configs (batch <= 8; cpu_reference_layers.py)
  repro               issue 17: every zoo and sweep layer timed by two processes (the second in
                      reverse order), every sample kept; how well estimators reproduce
                      (measure_repro.py; env DEADLINE=250 per run)
  hetpar ARGS...      any hetpar command, e.g. `hetpar run resnet18 --steps 8`
                      (output in run_resnet18_<card>.txt)

two GPUs (env PROFILES: the profile file, default results/profile_2gpu_h200x2.json):
  two-gpus            hand-off probe; the built-in two-GPU sweep
  two-gpus-b256       transformer batch 256: one GPU, data parallel, half/half, memory case
  two-gpus-planned    transformer batch 256: the planner's pipelines M = 4, 8 (1F1B)
  two-gpus-launch     are microbatched pipelines launch-bound? (floor rows)
  two-gpus-memory     transformer too large for one GPU (0.6x its memory)
  two-gpus-replay     transformer b256 M = 1..8, and the memory case, replayed predictions
  two-gpus-study      VGG16 (b128) and AlexNet (b512), M = 1..16, GPipe and 1F1B
  two-gpus-measured   VGG16 and transformer with layer shares measured on the GPU
  two-gpus-final      transformer b256, final calibration (env PROFILES_PEER: the peer-link profile)
  peer                GPU -> GPU copy speed at pipeline sizes (probe_peer.py)
  predictions [PLANS] predicted against measured under hetpar.auto, spec sheets and
                      profile='measure' (bench_predictions.py; PLANS: names or parts of
                      names, default all; env BATCH=256, MEMORY_FRACTION=0.7,
                      OFFLOAD_FRACTION=0.5, BUDGET=560,
                      PROFILE_KINDS="auto measure", ANCHORS=1: time a pipeline's anchors)
  step-timing [BATCHES]
                      the step every way, interleaved, one GPU and data parallel over two
                      (probe_step_timing.py --data_parallel; default batch 16)
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
profile|costs|cross-card|runtime|baselines|launch|overhead|rows|dispatch|layer-sweep|repro|plan-memory|profile-links|links|fit-check|cpu-timing|cpu-reference|hetpar) TWO_GPUS= ;;
two-gpus|two-gpus-b256|two-gpus-planned|two-gpus-launch|two-gpus-memory|two-gpus-replay|\
two-gpus-study|two-gpus-measured|two-gpus-final|peer|sweep|predictions|step-timing) TWO_GPUS=1 ;;
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
  if [ -z "${TAG:-}" ]; then
    timeout 90 python3 probe_handoff.py 2>&1 | quiet | tee "$OUT/probe_handoff_$CARD.txt"
  fi
  MODELS=${MODELS:-lm_embed,mlp,rnn,cnn_preprocess,conv6,mobilenet_v1,resnet18,alexnet,cyclegan_generator,transformer}
  name="baselines_$CARD${TAG:-}"
  timeout $(( ${BUDGET:-560} - ($(date +%s) - start) )) python3 bench_baselines.py \
    --out "$OUT/$name" --models "$MODELS" --memory_model "${MEMORY-transformer}" \
    ${PROFILES:+--profiles $PROFILES} 2>&1 | quiet > "$OUT/$name.log"
  grep -A12 "^## Goals" "$OUT/$name.md"
  ;;
launch)
  # How much of the transformer's step is fixed (kernel launches), with XLA's
  # CUDA-graph command buffers as they come, off, and on for every kind.
  cd experiments
  for flags in "" "--xla_gpu_enable_command_buffer=" \
      "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"; do
    XLA_FLAGS="$flags" timeout 130 python3 probe_launch.py --batches 16,64,256 \
      --out "$OUT/probe_launch_$CARD.jsonl" 2>&1 | grep "^batch\|^fit\|Error"
  done
  # The one-device path against jax.jit, interleaved (goal <= 1.03).
  timeout 150 python3 probe_overhead.py 2>&1 | quiet | tee "$OUT/probe_overhead_$CARD.txt"
  ;;
overhead)
  # The one-device path against jax.jit, interleaved (goal <= 1.03), then the VGG16 row.
  cd experiments
  timeout 140 python3 probe_overhead.py 2>&1 | quiet | tee "$OUT/probe_overhead_$CARD.txt"
  timeout 330 python3 bench_baselines.py --out "$OUT/baselines_${CARD}_vgg16" --models vgg16 \
    --memory_model "" --profiles "${PROFILES:-results/profile_gpu_h200.json}" 2>&1 | tail -3
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
dispatch)
  timeout 120 python3 experiments/probe_dispatch.py 2>&1 | quiet | tee "$OUT/probe_dispatch_$CARD.txt"
  ;;
layer-sweep)
  # Fit on many small layers, test on the zoo (issue 17, deliverable 2): the zoo's
  # saved layer records of this card (H100: cross_card/accuracy_v3_h100.json; H200
  # and the 16-core host CPU: accuracy_v3.json).
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache
  timeout "${SWEEP_TIMEOUT:-420}" python3 experiments/layer_sweep.py measure --out "$OUT" \
    --tag "$CARD" 2>&1 | grep -v "^[IW]1" | tail -5
  zoo=(experiments/results/accuracy_v3.json)  # H200 and the 16-core host CPU
  case "$CARD" in h100*) zoo+=(experiments/results/cross_card/accuracy_v3_h100.json) ;; esac
  python3 experiments/layer_sweep.py evaluate --sweep "$OUT/sweep_$CARD.json" \
    --records "${zoo[@]}" --out "$OUT/sweep_$CARD.md" 2>&1 | grep "^|"
  ;;
plan-memory)
  # Does a capped plan fit its cap on the real GPU? (probe_plan_memory.py)
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache
  for f in ${FRACTIONS:-0.25 0.1}; do
    timeout 240 python3 experiments/probe_plan_memory.py plan --batch "${BATCH:-16}" \
      --fraction "$f" --out "$OUT" 2>&1 | grep -E '^\{|Error' | cut -c1-600
    # shellcheck disable=SC2086  # RUN_FLAGS: several flags
    timeout 150 python3 experiments/probe_plan_memory.py run --batch "${BATCH:-16}" \
      --plan "$OUT/plan_$f.json" --out "$OUT" ${RUN_FLAGS:-} 2>&1 | grep -E '^\{|Error' | cut -c1-600
    for p in ${PREFETCHES:-}; do  # the same plan with Executor.PREFETCH = p: its peak
      timeout 120 python3 experiments/probe_plan_memory.py run --batch "${BATCH:-16}" \
        --plan "$OUT/plan_$f.json" --out "$OUT" --prefetch "$p" 2>&1 | grep -E '^\{|Error' \
        | cut -c1-600
    done
  done
  [ -n "${NO_JIT:-}" ] || timeout 120 python3 experiments/probe_plan_memory.py jit \
    --batch "${BATCH:-16}" --out "$OUT" 2>&1 | grep -E '^\{|Error' | cut -c1-600
  [ -z "${SAVE_CACHE:-}" ] || tar czf "$OUT/layer_cache.tgz" -C /tmp hetpar_cache
  ;;
profile-links)
  # Issue 17: hetpar profile (full) on this machine, then its link curves against
  # the engine's copies at sizes between the samples (profile_links.py)
  {
    t0=$(date +%s)
    timeout "${PROFILE_TIMEOUT:-300}" python3 -m hetpar profile --out "$OUT/profile_$CARD.json"
    echo "hetpar profile took $(( $(date +%s) - t0 )) s"
    timeout 200 python3 experiments/profile_links.py --profiles "$OUT/profile_$CARD.json" \
      --out "$OUT"
  } 2>&1 | quiet | tee "$OUT/profile_links_$CARD.log"
  ;;
links)
  # The transfer engine's copies GPU <-> host by size (probe_links.py)
  timeout 300 python3 experiments/probe_links.py --out "$OUT" 2>&1 | grep -v Warning
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
      ${REFIT:+--refit "$REFIT"} ${CHECK_DEVICES:+--devices "$CHECK_DEVICES"}
    echo "check took $(( $(date +%s) - t0 )) s"
    # The layer timings behind the fit, so it can be refitted offline.
    tar czf "$OUT/hetpar_cache_$CARD.tgz" -C /tmp hetpar_cache 2>/dev/null
  } 2>&1 | quiet | tee "$OUT/fit_check_$CARD.log"
  ;;
cpu-timing)
  # Issue 17: is the CPU's per-layer miss the model or the protocol?
  # shellcheck disable=SC2086  # TIMING_FLAGS: e.g. "--protocols interleaved --small_sweep"
  timeout "${TIMING_TIMEOUT:-540}" python3 experiments/probe_cpu_timing.py --out "$OUT" ${TIMING_FLAGS:-} \
    2>&1 | quiet | tee "$OUT/cpu_timing_$CARD.log"
  ;;
cpu-reference)
  # Issue 17: the CPU's layer model at reference sizes on this host's CPU.
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache
  {
    python3 -m hetpar profile --devices cpu:0 --no-transfers --out "$OUT/profile_cpu_$CARD.json"
    t0=$(date +%s)
    timeout "${REF_TIMEOUT:-480}" python3 experiments/cpu_reference_layers.py \
      --profiles "$OUT/profile_cpu_$CARD.json" --batch "${BATCH:-8}" --out "$OUT"
    echo "cpu_reference_layers took $(( $(date +%s) - t0 )) s"
  } 2>&1 | quiet | tee "$OUT/cpu_reference_$CARD.log"
  ;;
repro)
  # Run-to-run reproducibility of a layer's measured time (issue 17, deliverable 2).
  export HETPAR_CACHE_DIR=/tmp/hetpar_cache JAX_COMPILATION_CACHE_DIR=/tmp/jax_cc
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  for run in 1 2; do
    rev=(); [ $run = 2 ] && rev=(--reverse)
    timeout $(( ${DEADLINE:-250} + 40 )) python3 experiments/measure_repro.py measure \
      --out "$OUT" --tag "$CARD" --run $run --sweep --deadline_s "${DEADLINE:-250}" "${rev[@]}" \
      2>&1 | grep -E "done at|deadline" || echo "run $run failed"
  done
  python3 experiments/measure_repro.py compare "$OUT/repro_${CARD}_run1.json" \
    "$OUT/repro_${CARD}_run2.json" --out "$OUT/repro_$CARD.md"
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
step-timing)
  timeout "${BUDGET:-400}" python3 experiments/probe_step_timing.py ${PROBE_FLAGS:-} --batches "${@:-16}" \
    --data_parallel --out "$OUT/probe_step_timing_$CARD.json" 2>&1 | quiet | grep "batch"
  ;;
hetpar)
  # Named after the sub-command and its first argument: `hetpar run resnet18`
  # writes run_resnet18_<card>.txt.
  name=$(printf '%s\n' "${@:1:2}" | grep -v '^-' | paste -sd_ - | tr -c 'A-Za-z0-9_.\n-' '_')
  python3 -m hetpar "$@" 2>&1 | tee "$OUT/${name:-hetpar}_$CARD.txt"
  ;;
two-gpus)
  # Per-array against batched transfers, then two GPUs against one.
  (cd experiments
   timeout 120 python3 probe_handoff.py 2>&1 | quiet | tee "$OUT/probe_handoff_$CARD.txt"
   timeout 400 python3 bench_two_gpus.py --out "$OUT/two_gpus_$CARD" --budget_s 330 \
     --profiles "$PROFILES" 2>&1 | quiet | tail -30)
  ;;
two-gpus-b256)
  # The transformer at batch 256: one GPU, data parallel, the planner's choice
  # on a table calibrated to the measured one-GPU step, half/half pipelines
  # (M = 4, 8; GPipe and 1F1B), and a per-GPU budget of 0.7x what the step needs.
  (cd experiments
   timeout 560 python3 bench_two_gpus.py --out "$OUT/two_gpus_transformer_b256_$CARD" \
     --budget_s 440 --steps 10 --model transformer --batch 256 --microbatches 4,8 \
     --schedules gpipe,1f1b --memory_fraction 0.7 --profiles "$PROFILES" 2>&1 \
     | quiet | grep "^| [a-z]\|^calibrated\|Error\|error" | cut -c1-400)
  ;;
two-gpus-planned)
  # The planner's pipelines (M = 4, 8, 1F1B) beside one GPU, data parallel and
  # the planner's own choice.
  (cd experiments
   timeout 330 python3 bench_two_gpus.py --out "$OUT/two_gpus_transformer_b256_planned_$CARD" \
     --budget_s 270 --steps 10 --model transformer --batch 256 --microbatches 4,8 \
     --schedules 1f1b --nohalf --profiles "$PROFILES" 2>&1 \
     | quiet | grep "^| [a-z]\|^calibrated\|Error" | cut -c1-400)
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
two-gpus-memory)
  # A per-GPU budget of 0.6x what the step needs at batch 16: neither one GPU
  # nor a data-parallel replica fits; the planner pipelines it (M = 4, 1F1B).
  (cd experiments
   timeout 300 python3 bench_two_gpus.py --out "$OUT/two_gpus_transformer_memory_$CARD" \
     --budget_s 250 --steps 10 --model transformer --batch 16 --microbatches 4 \
     --schedules 1f1b --memory_only --memory_fraction 0.6 --profiles "$PROFILES" 2>&1 \
     | quiet | grep "^| [a-z]\|Error\|error" | cut -c1-600)
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
  sweep vgg16 128 1,2,4,8,16 220 two_gpus_vgg16_b128_measured --measure_layers
  sweep transformer 256 2,4,8 170 two_gpus_transformer_b256_measured --measure_layers \
    --schedules 1f1b
  ;;
two-gpus-final)
  # Fixed part from gradient-only steps, the peer link measured at pipeline
  # sizes (probe_peer.py -> profile_2gpu_h200x2_peer.json); M = 2, 4, 8 (1F1B).
  PROFILES=${PROFILES_PEER:-results/profile_2gpu_h200x2_peer.json}
  (cd experiments
   timeout 230 python3 bench_two_gpus.py --out "$OUT/two_gpus_transformer_b256_final_$CARD" \
     --budget_s 150 --steps 10 --model transformer --batch 256 --microbatches 2,4,8 \
     --schedules 1f1b --nohalf --nochoice --profiles "$PROFILES" 2>&1 \
     | quiet | grep "^| [a-z]\|^calibrated\|Error\|error" | cut -c1-300)
  ;;
peer)
  timeout 200 python3 experiments/probe_peer.py 2>&1 | quiet | tee "$OUT/probe_peer_$CARD.txt"
  ;;
sweep)
  sweep "$@"
  ;;
esac
echo "== $job took $(( $(date +%s) - start )) s; in $OUT:"
ls -la "$OUT"
