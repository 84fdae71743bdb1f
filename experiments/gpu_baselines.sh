#!/usr/bin/env bash
# Issue "measured comparisons" on the one-GPU machine: hetpar against its
# baselines for every zoo model, the memory-bound case, and the dispatch probe.
# Needs the pulp wheel in .whl/ (carried). Results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m pip install -q --no-index --find-links .whl pulp
python3 -m pip install -q --no-build-isolation --no-deps -e .
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
cd experiments
timeout 40 python3 probe_dispatch.py > "$OUT/probe_dispatch.txt" 2>&1
timeout 330 python3 bench_baselines.py --out "$OUT/baselines_h200" \
  --models lm_embed,mlp,rnn,cnn_preprocess,conv6,mobilenet_v1,resnet18,alexnet,cyclegan_generator,transformer \
  2>&1 | grep -v "^I1\|^W1" > "$OUT/baselines_h200.log"
echo "after main: $(( $(date +%s) - start )) s"
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python3 bench_baselines.py --out "$OUT/baselines_h200_big" --memory_model "" \
  --models resnet50,vgg16 2>&1 | grep -v "^I1\|^W1" > "$OUT/baselines_h200_big.log"
echo "total: $(( $(date +%s) - start )) s"
tail -5 "$OUT/baselines_h200.log"; cat "$OUT/probe_dispatch.txt" | tail -12
