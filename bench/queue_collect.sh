#!/bin/bash
# Copies every result a background queue (bench/queue_h200.sh) has written so far into $OUT, so that
# each watching call brings back what is finished: a machine lost between two calls (it goes back
# 30 s after a call) then loses only the runs still going. The queue's own files (/tmp/res: recipe
# runs' JSON and logs, queue.log) and the per-iteration JSON of the `sh` runs' parts, which
# bench/run_h200.sh keeps under its work folder until its end (/tmp/bench-work/MODE/...), go into
# one archive beside a copy of each JSON (a call returns few files: the archive holds everything).
#
#   bash bench/queue_collect.sh        # in a watching call, after `sleep N`
set -u
OUT=${OUT:?the output folder of the call}
mkdir -p "$OUT"
cat /tmp/res/queue.log 2>/dev/null
for f in $(find /tmp/res /tmp/bench-work -maxdepth 4 -name '*.json' 2>/dev/null | head -6); do
  name=${f#/tmp/}
  cp "$f" "$OUT/${name//\//_}"
done
tar -czf "$OUT/queue-results.tar.gz" -C /tmp $(cd /tmp && ls -d res bench-work 2>/dev/null) 2>/dev/null
ls -la "$OUT"
