#!/bin/bash
# The device calls of the LoRA and long-response benchmarks on an H200 machine, by mode; the modes
# named in one call run in order. Every mode first checks that /tmp holds what it needs and exits
# 3 at once if not (a reply with "warm": false means the machine was replaced: start again from
# the first call).
#
#   bash bench/run_h200.sh setup lora7b    # carry .carry = carry1 of bench/build_carry_h200.sh (vLLM
#                                          # whole + gin-config): install, then (a) 7B LoRA PPO
#   bash bench/run_h200.sh trl long2k      # carry .carry = carry2 (TRL wheels): install, then (b) 0.5B,
#                                          # 2048 new tokens: token budget vs micro-batch 8
#   bash bench/run_h200.sh peers           # (c) 7B LoRA GRPO, this engine vs TRL (peers/run_h200.sh lora7b)
#   bash bench/run_h200.sh long2k_mb4      # (b, optional) a fixed micro-batch of 4
#   bash bench/run_h200.sh setup threads   # carry1: the default 0.5B workload at 16, 8, 4, 2 torch threads
#   bash bench/run_h200.sh setup threads_compiled   # the same compiled at micro-batch 32: 16, 8, 4 threads
#   bash bench/run_h200.sh floor_local     # the default 0.5B PPO workload compiled at micro-batch 32 (forward
#                                          # 64, 4 torch threads), one process: 3 timed iterations, one more
#                                          # under torch.profiler (bench/profile_phases.py), the rollout parity
#   bash bench/run_h200.sh floor_colocated # the same on Ray, colocated (needs the Ray carry); `floor` runs both,
#                                          # then the one-process one again with ppo.overlap_rollout = False
#
# `setup` copies what .carry/vllm and .carry/gin hold into /tmp/vc and installs once all of vLLM
# is there, so the split carries carry1a then carry1b (`setup`, then `setup lora7b`) work too.
# No Ray: every run here is one process (ppo.placement local; TRL colocates vLLM in its own
# process). Each mode writes its figures and logs under /tmp/bench-work/<mode>/; on exit, even a
# failed one, the JSON and markdown files of this call's modes and one archive of their logs are
# copied to $OUT (a call returns at most 8 files). CALL_S (default 585) is the time the whole call
# may take from this script's start; each benchmark mode gets what is left of it (less 15 s),
# which gpu_ppo.py and peers/run_h200.sh split between their parts and pass down as time budgets,
# so a part stops before an iteration that would run past its limit and keeps what it measured.
# BENCH_TINY=1 (with BENCH_SITE=a folder holding a stub `vllm`) rehearses the benchmark modes on a
# CPU: gpu_assets.py and gpu_ppo.py get --tiny.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench-out}
WORK=${BENCH_WORK:-/tmp/bench-work}
CALL_S=${CALL_S:-585}
A7=${ASSETS_7B:-/tmp/assets-7b}
A05=${ASSETS_05B:-/tmp/assets-0.5b}
START=$(date +%s)
MODES=("$@")
mkdir -p "$OUT" "$WORK"
TINY=(); [ "${BENCH_TINY:-0}" = 1 ] && TINY=(--tiny)
export PYTHONPATH=${BENCH_SITE:-/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

log() { echo "[h200 $(( $(date +%s) - START ))s] $*"; }
left() { echo $(( CALL_S - ($(date +%s) - START) - 15 )); }
need() {  # need MODULE... : fail fast when /tmp/site lacks a module
  python3 -c "import $(IFS=,; echo "$*")" 2>/dev/null \
    || { log "missing on this machine: one of $* (the carry calls come first; the machine may have been replaced)"; exit 3; }
}
collect() {  # this call's JSON/markdown files and one archive of its logs into $OUT (at most 8 files)
  local dirs=() m
  for m in "${MODES[@]}"; do [ -d "$WORK/$m" ] && dirs+=("$m"); done
  [ ${#dirs[@]} -eq 0 ] && return
  for m in "${dirs[@]}"; do
    find "$WORK/$m" -maxdepth 2 -type f \( -name '*.json' -o -name '*.md' \) -exec cp {} "$OUT/" \;
  done
  for m in "${dirs[@]}"; do  # profiler traces, one file each (named by their variant's folder)
    for t in "$WORK/$m"/profile_*/step_*.trace.json.gz; do [ -f "$t" ] && cp "$t" "$OUT/$(basename "$(dirname "$t")").trace.json.gz"; done
  done
  (cd "$WORK" && find "${dirs[@]}" -maxdepth 2 -type f \( -name '*.log' -o -name '*.txt' \) -print0 \
     | tar --null -czf "$OUT/logs-$(IFS=_; echo "${dirs[*]}").tar.gz" -T -) 2>/dev/null
  echo "[h200] back in \$OUT ($(ls "$OUT" | wc -l) files): $(ls "$OUT" | tr '\n' ' ')"
}
trap collect EXIT
machine() {  # machine W: the GPU, its memory in use and the disk, into W/machine.txt
  { nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; df -h /tmp | tail -1;
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
    > "$1/machine.txt" 2>&1
  cat "$1/machine.txt"
}
sums() {  # sums DIR: the carry arrived whole
  [ -f "$1/SHA256SUMS" ] || { log "$1/SHA256SUMS missing: is .carry the right folder?"; exit 2; }
  (cd "$1" && sha256sum -c --quiet SHA256SUMS) || { log "$1: checksums differ"; exit 2; }
}

for MODE in "${MODES[@]}"; do
  W=$WORK/$MODE; mkdir -p "$W"
  case "$MODE" in
    setup)
      sums .carry
      mkdir -p /tmp/vc
      [ -d .carry/vllm ] && cp .carry/vllm/* /tmp/vc/
      if [ -d .carry/gin ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .carry/gin/*.whl || exit 3
      fi
      missing=$(for f in C_z.so.xz deps.tar.xz vrest.tar.xz vllm_unpack.py; do [ -f /tmp/vc/$f ] || echo -n "$f "; done)
      if [ -n "$missing" ]; then
        log "setup: vLLM not complete yet (waiting for: $missing); /tmp/vc has $(ls /tmp/vc | tr '\n' ' ')"
      else
        python3 /tmp/vc/vllm_unpack.py /tmp/vc 2>&1 | tee "$W/unpack.log" || exit 3
        need vllm gin
        python3 -c "import vllm, gin; print('vllm', vllm.__version__)" 2>&1 | tail -1 | tee -a "$W/unpack.log"
      fi
      machine "$W"
      ;;
    trl)
      need vllm gin  # the call before installed them: a replaced machine fails here, before any install
      sums .carry
      [ -d .carry/peers ] || { log "trl needs .carry/peers (carry2)"; exit 2; }
      bash .carry/peers/install.sh .carry/peers 2>&1 | tee "$W/install.log" || exit 3
      need trl datasets
      ;;
    lora7b|long2k|long2k_mb4|threads|threads_compiled)
      need vllm gin peft
      if [ "$MODE" = lora7b ]; then A=$A7; SHAPE=7b; PRESET=(--preset lora7b); else A=$A05; SHAPE=0.5b; PRESET=(--preset long2k); fi
      EXTRA=()
      if [ "$MODE" = long2k_mb4 ]; then EXTRA=(--variant "long2k_mb4=ppo.micro_batch_size = 4"); fi
      if [ "$MODE" = threads ]; then  # the default 0.5B workload, one process, by torch's intra-op threads
        PRESET=(--steps 2 --suffix threads_h200)
        for t in 16 8 4 2; do EXTRA+=(--variant "threads$t=ppo.torch_threads = $t"); done
      fi
      if [ "$MODE" = threads_compiled ]; then  # the same, compiled, micro-batch 32, forward micro-batch 64
        PRESET=(--steps 2 --suffix threads_compiled_h200)
        for t in 16 8 4; do
          EXTRA+=(--variant "compiled_threads$t=ppo.torch_compile = True; ppo.micro_batch_size = 32; ppo.forward_micro_batch_size = 64; ppo.torch_threads = $t")
        done
      fi
      if [ ! -f "$A/model/config.json" ]; then  # before the time split: the 7B build takes ~1 minute
        log "$MODE: building the $SHAPE inputs in $A"
        python3 bench/gpu_assets.py --shape $SHAPE --out "$A" "${TINY[@]}" 2>&1 | sed '/Writing model shards/d' | tee "$W/assets.log"
        [ -f "$A/model/config.json" ] || { log "$MODE: building the inputs failed"; exit 4; }
        du -sh "$A" | tee -a "$W/assets.log"
      fi
      machine "$W"
      L=$(left)
      if [ "$L" -lt 150 ]; then log "$MODE: only ${L}s left in the call, not started"; continue; fi
      log "$MODE: gpu_ppo ${PRESET[*]}, ${L}s for its variants"
      python3 bench/gpu_ppo.py "${PRESET[@]}" --assets "$A" --json-dir "$W" --total-time "$L" "${EXTRA[@]}" "${TINY[@]}" \
        > "$W/$MODE.log" 2>&1
      log "$MODE: rc=$?"
      grep -E "^(PPO iteration|  [a-z_]+ +[0-9.]+ ms|  [a-z_]+ +peak|variant |stopping|iteration )" "$W/$MODE.log" | tail -60
      ;;
    floor|floor_local|floor_colocated)
      need vllm gin
      [ "$MODE" = floor_local ] || need ray
      B="ppo.torch_compile = True; ppo.micro_batch_size = 32; ppo.forward_micro_batch_size = 64; ppo.torch_threads = 4"
      [ ${#TINY[@]} -gt 0 ] && B="ppo.micro_batch_size = 8; ppo.forward_micro_batch_size = 16; ppo.torch_threads = 1"
      B="$B${FLOOR_EXTRA:+; $FLOOR_EXTRA}"
      VARIANTS=()
      [ "$MODE" = floor_colocated ] || VARIANTS+=(--variant "floor_local=$B")
      [ "$MODE" = floor_local ] || VARIANTS+=(--variant "floor_colocated=$B; ppo.placement = 'colocated'")
      # The same one-process work with every phase in turn: what ppo.overlap_rollout gains, and the
      # same numbers step by step (step_results in the JSON).
      [ "$MODE" = floor_colocated ] || VARIANTS+=(--variant "floor_local_sequential=$B; ppo.overlap_rollout = False")
      machine "$W"
      L=$(left)
      if [ "$L" -lt 150 ]; then log "$MODE: only ${L}s left in the call, not started"; continue; fi
      log "$MODE: gpu_ppo, ${L}s for $(( ${#VARIANTS[@]} / 2 )) variant(s)"
      python3 bench/gpu_ppo.py --steps "${FLOOR_STEPS:-3}" --suffix "${FLOOR_SUFFIX:-h200}" --rollout-parity --profile \
        --assets "$A05" --json-dir "$W" --total-time "$L" "${VARIANTS[@]}" "${TINY[@]}" > "$W/$MODE.log" 2>&1
      log "$MODE: rc=$?"
      grep -E "^(PPO iteration|  [a-z_]+ +[0-9.]+ ms|variant |stopping|iteration |phase |[a-z_]+ +[0-9.]+ +[0-9.]+ +[0-9]+%)" "$W/$MODE.log" | tail -70
      ;;
    peers)
      need vllm gin peft trl datasets
      L=$(left)
      if [ "$L" -lt 360 ]; then log "peers: only ${L}s left in the call (two 7B systems need ~200 s each), not started"; continue; fi
      # Half of what is left for each system (the inputs' check takes ~20 s of the engine's half).
      OUT=$W PEERS_ASSETS_7B=$A7 PEERS_TOTAL_S=$L PEERS_BUDGET_ENGINE_GRPO_LORA7B=$(( L / 2 - 10 )) \
        PEERS_BUDGET_TRL_GRPO_LORA7B=$(( L / 2 )) bash bench/peers/run_h200.sh lora7b > "$W/peers.log" 2>&1
      log "peers: rc=$?"; tail -n 40 "$W/peers.log"
      ;;
    *) log "unknown mode $MODE"; exit 2 ;;
  esac
done
log "done"
