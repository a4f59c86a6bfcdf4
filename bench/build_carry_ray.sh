#!/bin/bash
# Builds, here (no GPU), the four carries that put Ray, W&B, vLLM, gin-config, TRL and verl on the
# GPU machine, one folder per device call (each under 64 MiB with the working tree):
#   nice -n 10 bash bench/build_carry_ray.sh /tmp/gpu-carry
#   call1/  Ray's wheelhouse, first batches   -> /tmp/wh
#   call2/  its last batch + assemble.sh      -> /tmp/wh, then installs /tmp/wh/*.whl into /tmp/site
#   call3/  vLLM's batch 1 (vllm1/) + the peers' wheels (peers/: TRL, datasets; verl in verl-site/)
#   call4/  vLLM's batch 2 (vllm2/): unpack into /tmp/site, install the peers' wheels, then work
# The wheelhouse (versions from constraints.txt where it pins them): ray, gin-config, rich, and
# wandb with every dependency the machine lacks (opentelemetry, cwevals, xxhash, sentry-sdk,
# gitpython, ...). Without them `import wandb` fails there, and so does TRL's import inside verl,
# which imports wandb whenever it is installed. The device commands, in order, are in
# bench/peers/README.md ("Ray, W&B, vLLM, TRL and verl: four calls").
set -euo pipefail
OUT=${1:?usage: build_carry_ray.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHARED=$(cd "$REPO/.." && pwd)/shared/device
[ -f "$SHARED/wheelhouse.py" ] || SHARED=/work/shared/device
VC=${VLLM_CARRY:-/tmp/vllm-carry}
PC=${PEERS_CARRY:-/tmp/peers-carry}
[ -f "$VC/batch-1/C_z.so.xz" ] && [ -f "$VC/batch-2/deps.tar.xz" ] || bash "$SHARED/vllm/build_carry.sh" "$VC"
[ -f "$PC/verl-site/verl-0.9.1-py3-none-any.whl" ] || bash "$REPO/bench/peers/build_carry.sh" "$PC"
pin() {  # pin NAME...: NAME==version from constraints.txt when it is pinned there, else NAME
  local n v
  for n in "$@"; do
    v=$(grep -i "^${n}==" "$REPO/constraints.txt" | head -1 | cut -d= -f3)
    if [ -n "$v" ]; then echo "$n==$v"; else echo "$n"; fi
  done
}
rm -rf "$OUT"; mkdir -p "$OUT"
WH=$OUT/.wheels
python3 "$SHARED/wheelhouse.py" download "$WH" $(pin ray jsonschema jsonschema-specifications referencing rpds-py \
  gin-config rich markdown-it-py mdurl pygments wandb sentry-sdk gitpython gitdb smmap platformdirs protobuf cwevals \
  xxhash googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-proto \
  opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common \
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common)
python3 "$SHARED/wheelhouse.py" pack "$WH" "$OUT/.batches"
last=$(ls -d "$OUT"/.batches/batch-* | tail -1)
mkdir -p "$OUT/call1" "$OUT/call2" "$OUT/call3/vllm1" "$OUT/call3/peers" "$OUT/call4/vllm2"
for b in "$OUT"/.batches/batch-*; do [ "$b" = "$last" ] || cp "$b"/* "$OUT/call1/"; done
cp "$last"/* "$OUT/call2/"
cp "$VC"/batch-1/* "$OUT/call3/vllm1/" && cp -r "$PC"/* "$OUT/call3/peers/"
cp "$VC"/batch-2/* "$OUT/call4/vllm2/"
rm -rf "$WH" "$OUT/.batches"
# The tree that travels with a carry call: reports/ and bench/results/ are moved out for those calls
# (.cache/hold/, see bench/peers/README.md), so they do not count here.
TREE=$(cd "$REPO" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
  | grep -zv -e '^reports/' -e '^bench/results/' | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
LIMIT=$((64 * 1024 * 1024))
for c in call1 call2 call3 call4; do
  size=$(du -sb "$OUT/$c" | cut -f1)
  echo "$c: $size bytes; with the working tree: $((size + TREE)) of $LIMIT"
  [ $((size + TREE)) -lt "$LIMIT" ] || { echo "$c does not fit one call (reports/ and bench/results/ moved out): split the wheelhouse further"; exit 1; }
done
