#!/bin/bash
# Benchmark runs one after another in the background on the device machine, so that one run may
# outlast a 10-minute device call and no call waits idle between runs (device time counts while the
# machine is held, busy or not). Start it once, detached, from the call that finished the installs:
#
#   cp bench/queue_h200.sh /tmp/ && printf '%s\n' "$RUN1" "$RUN2" > /tmp/queue.txt
#   setsid nohup bash /tmp/queue_h200.sh "$PWD" > /tmp/queue.out 2>&1 < /dev/null &
#
# Each line of /tmp/queue.txt is `NAME ARGS...` for bench/recipe_run.py (quoted as in a shell, e.g.
# `l7 --recipe models/lora.gin --shape 7b --assets /tmp/assets-7b --out /tmp/runs/l7 --steps 10`);
# a line `sh NAME COMMAND...` runs COMMAND (as written: `bash -c`) in the repo copy instead (e.g. `sh peers bash
# bench/run_h200.sh peers`, whose files go to /tmp/res/NAME/ as its $OUT). The first line is taken off
# before its run starts, so the rest can be edited while one runs. Each run writes /tmp/res/NAME.json
# (a recipe run) and NAME.log, and /tmp/res/queue.log says when each started and ended. Later calls watch and collect,
# each one, whatever is finished: `sleep N; bash bench/queue_collect.sh` (a machine lost between two
# calls loses only what it had not yet handed back). The runs
# use a copy of the repo in /tmp/repo, so the next call's copy of the tree does not change them.
set -u
export PYTHONPATH=${BENCH_SITE:-/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
  WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
R=/tmp/res
mkdir -p "$R" /tmp/runs
rm -rf /tmp/repo && mkdir -p /tmp/repo && (cd "${1:?the repo dir}" && tar --exclude=./.carry -cf - .) | (cd /tmp/repo && tar xf -)
cd /tmp/repo || exit 1
run() {
  local name=$1; shift
  echo "[queue $(date +%T)] start $name" >> "$R/queue.log"
  python3 bench/recipe_run.py "$@" --json "$R/$name.json" > "$R/$name.log" 2>&1 < /dev/null
  local rc=$?
  echo "[queue $(date +%T)] end $name rc=$rc" >> "$R/queue.log"
  # The run's checkpoints (~10 GB each at the 0.5B shape, two kept) are not part of its result: three
  # runs' filled the device's disk once, and the next run's last checkpoint failed (exit 4).
  local prev="" a
  for a in "$@"; do [ "$prev" = --out ] && rm -rf "$a/checkpoints"; prev=$a; done
}
sh() {
  local name=$1; shift
  echo "[queue $(date +%T)] start $name: $*" >> "$R/queue.log"
  mkdir -p "$R/$name"
  OUT="$R/$name" bash -c "$*" > "$R/$name.log" 2>&1 < /dev/null
  local rc=$?
  echo "[queue $(date +%T)] end $name rc=$rc" >> "$R/queue.log"
}
while true; do
  line=$(head -1 /tmp/queue.txt 2>/dev/null)
  [ -z "$line" ] && break
  sed -i 1d /tmp/queue.txt
  case "$line" in
    "sh "*) rest=${line#sh }; sh "${rest%% *}" "${rest#* }" ;;  # the command as written, unexpanded
    *) eval "run $line" ;;
  esac
done
echo "[queue $(date +%T)] all done" >> "$R/queue.log"
