#!/usr/bin/env bash
# Issue "measured comparisons" on the one-GPU machine: the hand-off probe, then
# hetpar against its baselines for the zoo models named in $MODELS (default:
# all but resnet50/vgg16, which a second call runs: MODELS=resnet50,vgg16
# TAG=_big MEMORY=""). Needs the pulp wheel in .whl/ (carried). Results: $OUT.
set -uo pipefail
source experiments/_gpu_setup.sh
start=$(date +%s)
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
cd experiments
if [ -z "${TAG:-}" ]; then
  timeout 90 python3 probe_handoff.py 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/probe_handoff.txt"
fi
MODELS=${MODELS:-lm_embed,mlp,rnn,cnn_preprocess,conv6,mobilenet_v1,resnet18,alexnet,cyclegan_generator,transformer}
timeout $(( ${BUDGET:-560} - ($(date +%s) - start) )) python3 bench_baselines.py \
  --out "$OUT/baselines_h200${TAG:-}" --models "$MODELS" --memory_model "${MEMORY-transformer}" ${PROFILES:+--profiles $PROFILES} \
  2>&1 | grep -v "^I1\|^W1" > "$OUT/baselines_h200${TAG:-}.log"
echo "total: $(( $(date +%s) - start )) s"
grep -A12 "^## Goals" "$OUT/baselines_h200${TAG:-}.md"
