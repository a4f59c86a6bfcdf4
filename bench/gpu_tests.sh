#!/bin/bash
# The GPU-only tests (not part of CI: they skip without CUDA), run on the lent H200 in one device
# call, with vLLM and gin-config carried as bench/run_h200.sh's `setup` installs them:
#   nice -n 10 bash bench/build_carry_h200.sh /tmp/h200-carry      # here, once
#   rm -rf .carry && cp -r /tmp/h200-carry/carry1 .carry
#   device run, carry [".carry"]:  GPU_TESTS_COMMIT=<the commit> bash bench/gpu_tests.sh
# Each test file runs in its own pytest under its own time limit (a hung engine costs one file),
# with a JUnit XML report; the reports are merged into $OUT/gpu_tests.json (date, commit, device,
# and each test's outcome: passed / failed / skipped / error / timeout) for bench/results/.
# TESTS_S (default 480) is the time all files together may take after set-up.
# The carry must hold vLLM whole: its engine imports llguidance at start-up. The device copies the
# session's checkout; from another checkout, carry a tarball of this tree (all of tests/: the GPU
# files import CPU test modules) beside .carry and run this script from where it unpacks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/bench-out}
START=$(date +%s)
TESTS_S=${TESTS_S:-480}
FILES=(tests/rlhf/test_packed_attention_gpu.py tests/rlhf/test_rollout_vllm_gpu.py tests/rlhf/test_distributed_gpu.py
       "tests/rlhf/test_engine.py::test_gpu_run_logs_memory_and_utilization_for_the_advisor")
mkdir -p "$OUT" /tmp/gpu-tests
if [ -d .carry ]; then
  OUT=/tmp/gpu-tests/setup bash bench/run_h200.sh setup > /tmp/gpu-tests/setup.log 2>&1 || { tail -20 /tmp/gpu-tests/setup.log; exit 3; }
  tail -3 /tmp/gpu-tests/setup.log
fi
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 RLHF_CACHE=/tmp/gpu-tests/cache
for i in "${!FILES[@]}"; do
  left=$(( TESTS_S - ($(date +%s) - START) ))
  if [ "$left" -lt 30 ]; then echo "[gpu_tests] no time left for ${FILES[$i]}"; continue; fi
  echo "[gpu_tests] ${FILES[$i]} (${left}s left)"
  timeout -k 10 "$left" python3 -m pytest -q -p no:cacheprovider "${FILES[$i]}" --junitxml "/tmp/gpu-tests/report-$i.xml" \
    > "/tmp/gpu-tests/pytest-$i.log" 2>&1
  rc=$?
  tail -5 "/tmp/gpu-tests/pytest-$i.log"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "${FILES[$i]}" >> /tmp/gpu-tests/timed_out.txt
done
python3 - "$OUT/gpu_tests.json" "${FILES[@]}" <<'EOF'
import datetime, json, os, pathlib, subprocess, sys
import xml.etree.ElementTree as ET
import torch
out, files = sys.argv[1], sys.argv[2:]
timed_out = set(pathlib.Path("/tmp/gpu-tests/timed_out.txt").read_text().split()) \
    if pathlib.Path("/tmp/gpu-tests/timed_out.txt").exists() else set()
tests = {}
for i, name in enumerate(files):
    report = pathlib.Path(f"/tmp/gpu-tests/report-{i}.xml")
    if not report.exists():
        tests[name] = {"outcome": "timeout" if name in timed_out else "not run"}
        continue
    for case in ET.parse(report).iter("testcase"):
        key = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, detail = "passed", None
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (node.get("message") or "")[:500]
        tests[key] = {"outcome": outcome, "seconds": round(float(case.get("time", 0)), 2),
                      **({"detail": detail} if detail else {})}
commit = os.environ.get("GPU_TESTS_COMMIT")  # the device's copy of the tree has no .git: the caller says
if not commit:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except OSError:
        commit = None
counts = {}
for t in tests.values():
    counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
          "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
          "torch": torch.__version__, "counts": counts, "tests": tests}
pathlib.Path(out).write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(counts))
EOF
cp /tmp/gpu-tests/pytest-*.log "$OUT/" 2>/dev/null
exit 0
