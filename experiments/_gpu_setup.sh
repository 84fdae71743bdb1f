# Sourced by the gpu_*.sh scripts: install hetpar and pulp on the GPU machine
# (no package index there: the pulp wheel travels in .whl/) and name the cards.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl pulp
python3 -m pip install -q --no-build-isolation --no-deps -e .
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
