#!/bin/bash
# Builds the wheels the peer benchmarks need on the GPU machine beyond its own packages and the
# Ray + vLLM carry (../../../shared/device/README.md), as one folder small enough to ride along
# with another carry batch. Run here (no GPU), from the repo root:
#   nice -n 10 bash bench/peers/build_carry.sh /tmp/peers-carry
#   nice -n 10 bash bench/peers/build_carry.sh /tmp/peers-carry --trl-only   # no verl (2 MB)
# site/ also holds gin-config, which the engine imports and the machine lacks (the Ray batches
# bring it too; a run without Ray, such as run_h200.sh lora7b, gets it from here).
# Output: OUT/site/ (TRL: into /tmp/site), OUT/verl-site/ (verl and what it pins: into
# /tmp/site-verl, which only verl's process puts first on PYTHONPATH, because it holds
# transformers 5.9.0 + tokenizers 0.22.2 that verl 0.9.1 pins below the machine's 5.17),
# OUT/SHA256SUMS and OUT/install.sh. About 20 MB.
set -euo pipefail
OUT=${1:?usage: build_carry.sh OUTDIR [--trl-only]}
TRL_ONLY=0; [ "${2:-}" = --trl-only ] && TRL_ONLY=1
WH=$(cd "$(dirname "$0")/../../.." && pwd)/shared/device/wheelhouse.py
[ -f "$WH" ] || WH=/work/shared/device/wheelhouse.py
rm -rf "$OUT"; mkdir -p "$OUT/site"
python3 "$WH" download "$OUT/site" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gin-config==0.5.0
if [ "$TRL_ONLY" = 1 ]; then
  (cd "$OUT" && sha256sum site/*.whl > SHA256SUMS)
  cp "$(dirname "$0")/install_carry.sh" "$OUT/install.sh"
  du -sh "$OUT"; exit 0
fi
mkdir -p "$OUT/verl-site"
python3 "$WH" download "$OUT/verl-site" verl==0.9.1 hydra-core==1.3.8 omegaconf==2.3.0 codetiming==1.4.0 \
  tensordict==0.10.0 pyvers==0.1.0 orjson cloudpickle importlib_metadata zipp torchdata==0.11.0 pylatexenc==2.11 \
  transferqueue==0.1.11 prometheus_client uvicorn h11 einops model-hosting-container-standards==0.1.16 jmespath \
  transformers==5.9.0 tokenizers==0.22.2 trl==1.12.0
# trl 1.12.0: the newest TRL that still has AutoModelForCausalLMWithValueHead (trl.experimental.ppo; gone
# from 1.13 on), which verl imports in apply_monkey_patch (every model, when trl is importable) and as its
# critic's fallback; here it shadows /tmp/site's TRL 1.16 for verl's processes only. Its other needs
# (accelerate, datasets, jinja2, packaging) are on the machine or in site/.
# hydra-core needs antlr4-python3-runtime 4.9.*, published as source only: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w "$OUT/verl-site" antlr4-python3-runtime==4.9.3
(cd "$OUT" && sha256sum site/*.whl verl-site/*.whl > SHA256SUMS)
cp "$(dirname "$0")/install_carry.sh" "$OUT/install.sh"
du -sh "$OUT" "$OUT"/site "$OUT"/verl-site
