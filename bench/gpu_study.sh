#!/bin/bash
# A tuning round on a GPU machine through the user's command (not a test): a study file, by
# default recipes/studies/gpu_tiny.gin (baseline + 2 variants x 2 seeds of the tiny default with
# vLLM, four runs sharing the GPU), run with `python -m experiments run`, then the same command
# again, which must serve every run from what finished. Needs /tmp/site with Ray, vLLM,
# gin-config, wandb and rich (the carries of bench/peers/README.md); W&B writes offline files.
#   bash bench/gpu_study.sh [STUDY_FILE]
# Writes $OUT/gpu_study.tar.gz: the results (run dirs without checkpoints, report, aggregate,
# plan, W&B offline files), both commands' output and calls.json (each command, its exit code
# and wall seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
STUDY=${1:-recipes/studies/gpu_tiny.gin}
OUT=${OUT:-/tmp/study-out}
W=${STUDY_WORK:-/tmp/study-work}
mkdir -p "$OUT" "$W"
export PYTHONPATH=${BENCH_SITE:-/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -c "import ray, vllm, gin, wandb, rich; print('ray', ray.__version__, 'vllm', vllm.__version__, 'wandb', wandb.__version__)" \
  || { echo "missing on this machine: ray, vllm, gin, wandb or rich (the carry calls come first)"; exit 3; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$W/gpu.txt"
calls=()
for i in 1 2; do
  t0=$(date +%s.%N)
  python3 -m experiments run "$STUDY" --results "$W/results" > "$W/run$i.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  calls+=("{\"command\": \"python -m experiments run $STUDY --results results\", \"exit_code\": $rc, \"wall_s\": $(python3 -c "print(round($t1 - $t0, 1))")}")
  echo "[study] run $i: rc=$rc"; tail -n 25 "$W/run$i.log"
done
(IFS=,; echo "[${calls[*]}]") > "$W/calls.json"
tar --exclude=checkpoints -czf "$OUT/gpu_study.tar.gz" -C "$W" results run1.log run2.log calls.json gpu.txt
ls -la "$OUT"
