#!/bin/bash
# On the GPU machine: installs the peers' wheels carried in DIR (default: the folder of this file).
#   bash DIR/install.sh [DIR]
# DIR/site/*.whl -> /tmp/site (beside Ray and vLLM); DIR/verl-site/*.whl -> /tmp/site-verl (when
# the carry has them: build_carry.sh --trl-only leaves verl out).
set -euo pipefail
D=$(cd "${1:-$(dirname "$0")}" && pwd)
SITE=${PEERS_SITE:-/tmp/site}
VSITE=${PEERS_VERL_SITE:-/tmp/site-verl}
cd "$D" && sha256sum -c --quiet SHA256SUMS
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" ${PEERS_PIP_ARGS:-} "$D"/site/*.whl
if compgen -G "$D/verl-site/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$VSITE" ${PEERS_PIP_ARGS:-} "$D"/verl-site/*.whl
  # verl 0.9.1's critic loader (verl/utils/model.py: load_valuehead_model) hard-codes
  # attn_implementation="flash_attention_2" in both its from_pretrained calls, and this machine has no
  # flash-attn: make them take the model config's (the critic's override_config.attn_implementation).
  python3 - "$VSITE/verl/utils/model.py" <<'PATCH'
import re, sys
path = sys.argv[1]
src = open(path).read()
old = 'attn_implementation="flash_attention_2",'
new = 'attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",'
start = src.index("\ndef load_valuehead_model(")
end = re.compile(r"\n(?=\S)").search(src, start + 1).start()  # the next top-level statement
body = src[start:end]
n_old, n_new = body.count(old), body.count(new)
if (n_old, n_new, src.count(old)) == (2, 0, 2):
    open(path, "w").write(src[:start] + body.replace(old, new) + src[end:])
    print(f"peers: patched {path}: load_valuehead_model takes the config's attention, not flash_attention_2 (2 calls)")
elif (n_old, n_new) == (0, 2):
    print(f"peers: {path} already patched (load_valuehead_model takes the config's attention)")
else:
    sys.exit(f"peers: cannot patch {path}: load_valuehead_model has {n_old} hard-coded flash_attention_2 and "
             f"{n_new} patched calls (whole file: {src.count(old)} hard-coded); expected 2 and 0, or 0 and 2")
PATCH
  echo "peers: installed into $SITE (TRL) and $VSITE (verl)"
else
  echo "peers: installed into $SITE (TRL, gin-config); no verl in this carry"
fi
