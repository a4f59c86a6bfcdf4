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
  echo "peers: installed into $SITE (TRL) and $VSITE (verl)"
else
  echo "peers: installed into $SITE (TRL, gin-config); no verl in this carry"
fi
