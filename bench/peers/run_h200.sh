#!/bin/bash
# Runs the peer benchmarks and this engine on the same work on an H200 machine, one part after the
# other, each under its own time limit, all inside one device call (10 minutes at most).
#
#   bash bench/peers/run_h200.sh grpo     # TRL GRPOTrainer (no GC, GC) + engine GRPO (local, colocated)
#   bash bench/peers/run_h200.sh ppo      # engine PPO (local, colocated) + verl main_ppo
#   bash bench/peers/run_h200.sh smoke    # imports and inputs only (seconds)
#   bash bench/peers/run_h200.sh lora7b   # GRPO at the Qwen2.5-7B shape with LoRA rank 64 + gradient
#                                         # checkpointing: engine (local) + TRL GRPOTrainer (peft_config)
#   bash bench/peers/run_h200.sh verl_lora7b   # the same work on verl main_ppo (its own LoRA settings; Ray)
#
# Needs /tmp/site (Ray + vLLM carry, ../../../shared/device/README.md) with the peers' wheels
# installed by bench/peers/install_carry.sh (TRL into /tmp/site, verl into /tmp/site-verl).
# lora7b needs no Ray and no verl: vLLM, TRL + datasets and gin-config in /tmp/site (the machine
# has peft); its inputs (15 GB of random 7B weights, drawn on the GPU) go to PEERS_ASSETS_7B
# (default /tmp/assets-7b, the directory bench/gpu_ppo.py --preset lora7b uses: built once).
# Writes $OUT/peers/*.json (one per system and variant, each rewritten after every step, so a part
# cut by its limit keeps the steps it finished), their logs, and $OUT/peers/peers_h200.md.
# Each part runs under `timeout` with the budget written beside it below (seconds; override with
# PEERS_BUDGET_<PART>=..., e.g. PEERS_BUDGET_VERL_PPO=300), cut to what is left of PEERS_TOTAL_S
# (default 575) for the whole call; a part with under 30 s left is skipped and says so. The last
# part of each mode (the Ray placement) has the largest budget: it takes whatever the others left.
# PEERS_ENGINE_BINDING="ppo.x = y" adds one gin binding to the engine's lora7b and ppo parts (e.g. the binding the
# memory plan names on a smaller GPU: on an 80 GB H100 `ppo.max_tokens_per_micro_batch = 8192` for lora7b, 12288 for ppo).
# PEERS_SKIP="name name ..." leaves those parts out (e.g. PEERS_SKIP="trl_grpo_no_gc engine_grpo_local").
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?usage: run_h200.sh grpo|ppo|smoke|lora7b|verl_lora7b}
OUT=${OUT:-/tmp/peers-out}
R=$OUT/peers
mkdir -p "$R"
ASSETS=${PEERS_ASSETS:-/tmp/peer-assets}
SHAPE=0.5b
case "$MODE" in lora7b|verl_lora7b) ASSETS=${PEERS_ASSETS_7B:-/tmp/assets-7b}; SHAPE=7b ;; esac
LORA_RANK=${PEERS_LORA_RANK:-64}
TOTAL=${PEERS_TOTAL_S:-575}
ST=${PEERS_STEPS:-2}          # timed iterations after 1 warm-up (engine, verl)
TST=${PEERS_TRL_STEPS:-3}     # timed steps after 1 warm-up (TRL: its steps are the cheapest)
START=$(date +%s)
export PYTHONPATH=${BENCH_SITE:-/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1

log() { echo "[peers $(( $(date +%s) - START ))s] $*"; }

# Fail fast: the machine may have been replaced (empty /tmp).
if [ "$MODE" = lora7b ]; then
  python3 -c "import vllm, trl, datasets, gin, peft; print('vllm', vllm.__version__, 'trl', trl.__version__, 'peft', peft.__version__)" \
    || { log "missing carry: /tmp/site lacks vllm/trl/datasets/gin (install the carry batches first)"; exit 3; }
else
python3 -c "import ray, vllm, trl, datasets; print('ray', ray.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__)" \
  || { log "missing carry: /tmp/site lacks ray/vllm/trl (install the carry batches first)"; exit 3; }
fi
if [ "$MODE" = smoke ]; then  # everything verl's processes import, vLLM's server side included
  PYTHONPATH=/tmp/site-verl:/tmp/site python3 -c "
import verl, transformers, tokenizers, tensordict, hydra, transfer_queue
import vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.serve
import verl.trainer.main_ppo, verl.trainer.ppo.v1.trainer_sync, verl.workers.engine_workers
import verl.workers.rollout.vllm_rollout.vllm_async_server, verl.experimental.agent_loop, verl.experimental.reward_loop
print('verl', verl.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)
" 2>&1 | tail -n 3 | tee "$R/verl_imports.txt"
elif [ "$MODE" = ppo ] || [ "$MODE" = verl_lora7b ]; then
  PYTHONPATH=/tmp/site-verl:/tmp/site python3 -c "import verl, transformers, tensordict, hydra, transfer_queue; print('verl', verl.__version__, 'transformers', transformers.__version__)" \
    || log "verl site incomplete: the verl part will fail (see its log)"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$R/gpu.txt"

# Shared inputs once (model with random weights, full-vocabulary tokenizer, prompts).
python3 -c "
import sys; sys.path.insert(0, 'bench/peers'); import common
inputs = common.build_inputs('$ASSETS', shape='$SHAPE'); common.check_assets(inputs); print('inputs ready:', inputs)
" || { log "building the inputs failed"; exit 4; }
[ "$MODE" = smoke ] && { log "smoke done"; exit 0; }

gpu_idle() {  # wait (up to 30 s) until the previous part's GPU memory is released
  for _ in $(seq 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | head -1)
    [ "${used:-0}" -lt 2000 ] && return 0
    sleep 1
  done
  log "GPU still holds ${used} MiB after the previous part"
}

failed_early() {  # failed_early JSON SECONDS: the part logged no step and ended before SECONDS
  python3 -c "import json, sys; r = json.load(open('$1')); sys.exit(0 if not r.get('steps') and r.get('wall_s', 1e9) < $2 else 1)" 2>/dev/null
}

part() {  # part NAME BUDGET_S [ENV=VAL ...] -- COMMAND...
  local name=$1 budget=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  case " ${PEERS_SKIP:-} " in *" $name "*) log "$name: skipped (PEERS_SKIP)"; return ;; esac
  local var="PEERS_BUDGET_${name^^}"; budget=${!var:-$budget}
  local left=$(( TOTAL - ($(date +%s) - START) - 5 ))
  if [ "$left" -lt 30 ]; then log "$name: skipped (no time left)"; echo "{\"part\": \"$name\", \"skipped\": \"no time left in the call\"}" > "$R/$name.skipped.json"; return; fi
  [ "$left" -lt "$budget" ] && budget=$left
  gpu_idle
  log "$name: start (limit ${budget}s): ${envs[*]} $*"
  local t0=$(date +%s)
  env "${envs[@]}" PEERS_PART_LIMIT_S="$budget" setsid timeout -k 15 "$budget" "$@" > "$R/$name.log" 2>&1 &
  local pid=$!
  wait $pid; local rc=$?
  kill -- -$pid 2>/dev/null  # whatever the part left in its process group
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then log "$name: stopped at its limit"; fi
  log "$name: rc=$rc in $(( $(date +%s) - t0 ))s; tail:"; tail -n 4 "$R/$name.log"
  if [ "${RAY_PART:-0}" = 1 ]; then python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1; fi
}

case "$MODE" in
  grpo)
    part trl_grpo_no_gc 150 -- python3 bench/peers/trl_grpo.py --assets "$ASSETS" --json "$R/trl_grpo_no_gc.json" --steps "$TST"
    part engine_grpo_local 150 -- python3 bench/peers/engine.py --assets "$ASSETS" --algo grpo --placement local --json "$R/engine_grpo_local.json" --steps "$ST"
    part trl_grpo_gc 120 -- python3 bench/peers/trl_grpo.py --assets "$ASSETS" --json "$R/trl_grpo_gc.json" --steps "$TST" --gradient-checkpointing
    RAY_PART=1 part engine_grpo_colocated 250 -- python3 bench/peers/engine.py --assets "$ASSETS" --algo grpo --placement colocated --json "$R/engine_grpo_colocated.json" --steps "$ST"
    ;;
  ppo)
    # verl first: its start-up (Ray, three FSDP workers, a vLLM server with CUDA graphs) is the longest part
    RAY_PART=1 part verl_ppo 440 PYTHONPATH=/tmp/site-verl:/tmp/site -- python3 bench/peers/verl_ppo.py --assets "$ASSETS" --json "$R/verl_ppo.json" --steps "$ST"
    # verl's default (v1) trainer failed early with no step logged: try its legacy trainer (no TransferQueue)
    if failed_early "$R/verl_ppo.json" 150; then
      RAY_PART=1 part verl_ppo_v0 300 PYTHONPATH=/tmp/site-verl:/tmp/site -- python3 bench/peers/verl_ppo.py --assets "$ASSETS" --json "$R/verl_ppo_v0.json" --steps "$ST" --trainer v0
    fi
    # The engine as the shipped 0.5B recipe computes the work (models/instruct.gin: packed micro-batches, compile)
    ENG=(python3 bench/peers/engine.py --assets "$ASSETS" --algo ppo --recipe models/instruct.gin ${PEERS_ENGINE_BINDING:+-b "$PEERS_ENGINE_BINDING"} --steps "$ST")
    part engine_ppo_local 150 -- "${ENG[@]}" --placement local --json "$R/engine_ppo_local.json"
    RAY_PART=1 part engine_ppo_colocated 250 -- "${ENG[@]}" --placement colocated --json "$R/engine_ppo_colocated.json"
    ;;
  verl_lora7b)
    # verl's LoRA path (the adapter as a vLLM LoRA request); if it fails early, its merged path
    VERL7=(python3 bench/peers/verl_ppo.py --assets "$ASSETS" --algo grpo --shape 7b --lora-rank "$LORA_RANK" --gradient-checkpointing --steps "${PEERS_STEPS_7B:-2}")
    RAY_PART=1 part verl_grpo_lora7b 560 PYTHONPATH=/tmp/site-verl:/tmp/site -- "${VERL7[@]}" --json "$R/verl_grpo_lora7b.json"
    if failed_early "$R/verl_grpo_lora7b.json" 240; then
      RAY_PART=1 part verl_grpo_lora7b_merged 560 PYTHONPATH=/tmp/site-verl:/tmp/site -- "${VERL7[@]}" --lora-merge --json "$R/verl_grpo_lora7b_merged.json"
    fi
    ;;
  lora7b)
    # The engine first (its LoRA path is the newer code), then TRL; each loads the 15 GB base and starts vLLM.
    # The engine computes the work as the shipped 7B recipe does (models/lora.gin); TRL as it runs LoRA.
    part engine_grpo_lora7b 280 -- python3 bench/peers/engine.py --assets "$ASSETS" --shape 7b --algo grpo --placement local --recipe models/lora.gin --lora-rank "$LORA_RANK" ${PEERS_ENGINE_BINDING:+-b "$PEERS_ENGINE_BINDING"} --json "$R/engine_grpo_lora7b.json" --steps "${PEERS_STEPS_7B:-2}"
    part trl_grpo_lora7b 280 -- python3 bench/peers/trl_grpo.py --assets "$ASSETS" --shape 7b --lora-rank "$LORA_RANK" --json "$R/trl_grpo_lora7b.json" --steps "${PEERS_TRL_STEPS_7B:-2}"
    ;;
  *) echo "unknown part $MODE"; exit 2 ;;
esac

python3 bench/peers/make_table.py "$R" --out "$R/peers_h200.md" && cat "$R/peers_h200.md"
log "done"
