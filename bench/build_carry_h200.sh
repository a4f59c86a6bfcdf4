#!/bin/bash
# Builds, here (no GPU), the carries of bench/run_h200.sh's device calls, from the repo root:
#   nice -n 10 bash bench/build_carry_h200.sh /tmp/h200-carry
# Output (never committed; each call copies one folder to .carry, which .git/info/exclude ignores):
#   OUT/carry1/   vLLM 0.24.0 whole (the two batches of ../shared/device/vllm/build_carry.sh, with
#                 vrest.tar.xz recompressed at xz -9e: same tar, 3 MB smaller, so that both batches
#                 and the working tree fit the 64 MiB of one call) + the gin-config wheel
#   OUT/carry1a/, OUT/carry1b/   the same split in two, for when carry1 and the tree do not fit
#   OUT/carry2/   the peers' TRL wheels (trl, datasets, dill, multiprocess; bench/peers/build_carry.sh --trl-only)
#   OUT/carry12/  carry1 and carry2 together (1 MB to spare beside the tree): the first call again after
#                 the machine was replaced, when (b) and (c) are still to come
#   OUT/carry1b2/ carry1b and carry2 together: with carry1a, both in one call (carry [".carry_a", ".carry_b"],
#                 63 MB: reports/ and bench/results/ moved out of the tree for it), then
#                 `mv .carry_a .carry && bash bench/run_h200.sh setup; rm -rf .carry; mv .carry_b .carry &&
#                 bash bench/run_h200.sh setup trl` installs vLLM, gin-config and TRL in one call
# Each folder holds a SHA256SUMS of its files, checked on the device before anything is installed.
# Takes ~10 minutes on 2 cores (the vLLM download and xz -9e), less when VLLM_CARRY (default
# /tmp/vllm-carry) already holds build_carry.sh's batches.
set -euo pipefail
OUT=${1:?usage: build_carry_h200.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHARED=$(cd "$REPO/.." && pwd)/shared/device
[ -f "$SHARED/vllm/build_carry.sh" ] || SHARED=/work/shared/device
VC=${VLLM_CARRY:-/tmp/vllm-carry}
[ -f "$VC/batch-1/C_z.so.xz" ] && [ -f "$VC/batch-2/deps.tar.xz" ] || bash "$SHARED/vllm/build_carry.sh" "$VC"
rm -rf "$OUT"; mkdir -p "$OUT/carry1/vllm" "$OUT/carry1/gin" "$OUT/carry1a/vllm" "$OUT/carry1a/gin" "$OUT/carry1b/vllm"
cp "$VC"/batch-1/C_z.so.xz "$VC"/batch-2/deps.tar.xz "$VC"/batch-2/vllm_unpack.py "$OUT/carry1/vllm/"
xz -dc "$VC/batch-2/vrest.tar.xz" | xz -T2 -9e > "$OUT/carry1/vllm/vrest.tar.xz"
[ "$(xz -dc "$VC/batch-2/vrest.tar.xz" | sha256sum)" = "$(xz -dc "$OUT/carry1/vllm/vrest.tar.xz" | sha256sum)" ]
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d "$OUT/carry1/gin" gin-config==0.5.0
cp "$OUT/carry1/vllm/C_z.so.xz" "$OUT/carry1a/vllm/" && cp "$OUT"/carry1/gin/* "$OUT/carry1a/gin/"
cp "$OUT"/carry1/vllm/{deps.tar.xz,vrest.tar.xz,vllm_unpack.py} "$OUT/carry1b/vllm/"
bash "$REPO/bench/peers/build_carry.sh" "$OUT/carry2/peers" --trl-only
mkdir -p "$OUT/carry12" && cp -r "$OUT/carry1/vllm" "$OUT/carry1/gin" "$OUT/carry2/peers" "$OUT/carry12/"
mkdir -p "$OUT/carry1b2" && cp -r "$OUT/carry1b/vllm" "$OUT/carry2/peers" "$OUT/carry1b2/"
for c in carry1 carry1a carry1b carry2 carry12 carry1b2; do
  (cd "$OUT/$c" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum > SHA256SUMS)
done
TREE=$(cd "$REPO" && { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
LIMIT=$((64 * 1024 * 1024))
for c in carry1 carry1a carry1b carry2 carry12 carry1b2; do
  size=$(du -sb "$OUT/$c" | cut -f1)
  echo "$c: $size bytes; with the working tree ($TREE): $((size + TREE)) of $LIMIT ($(( (LIMIT - size - TREE) / 1024 )) KiB to spare)"
done
