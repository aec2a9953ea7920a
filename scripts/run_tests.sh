#!/usr/bin/env bash
# The test suite as `make test` (and so CI) runs it: tests/e2e, tests/integration and tests/unit, each in a pytest
# process of its own. A part that freezes whole, so that not even pytest-timeout's per-test alarm can run (a
# C-level deadlock inside a library, e.g. gRPC's GIL deadlock on channel close, grpc/grpc#42247), is stopped at its
# time limit with the servers it started (the tests' etcd runs in a session of its own), the innermost frames of each
# thread in its stack dumps are printed, and it runs once more. A part whose tests fail is not run again. Each run
# keeps its temporary files in a folder of its own, removed when it passes. Extra arguments go to every pytest run.
#   FLOWMAKER_TEST_PART_LIMIT  time limit of one run of a part (default 25m; each part takes 1-12 min here)
#   FLOWMAKER_TEST_PARTS       the parts, space-separated (default: tests/e2e tests/integration tests/unit)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
limit=${FLOWMAKER_TEST_PART_LIMIT:-25m}
read -r -a parts <<< "${FLOWMAKER_TEST_PARTS:-tests/e2e tests/integration tests/unit}"
status=0
for part in "${parts[@]}"; do
  for attempt in 1 2; do
    log=$(mktemp)
    # The run's temporary files in a folder of its own: the servers the tests start keep their data there (etcd's
    # --data-dir), which names them below if the run freezes.
    base=$(mktemp -d)
    # timeout runs pytest in a process group of its own and signals the whole group: the servers it started go too
    timeout -k 30 "$limit" "$PY" -m pytest -q "$part" --basetemp "$base" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "== FROZEN: $part gave no result within $limit (run $attempt of 2); innermost frames of each thread:"
      awk '/^(Thread|Current thread) 0x/ {print; n=4; next} n > 0 && /^  File/ {print; n--}' "$log" | tail -n 60
      # what escaped the group (a server in a session of its own, as the tests' etcd is) and still runs: from this
      # checkout, or with its data in this run's folder
      pkill -KILL -f "$PWD/$PY" 2>/dev/null || true
      pkill -KILL -f "$base" 2>/dev/null || true
    fi
    if grep -q "STUCK TASK" "$log"; then
      # tasks a test left that would not end (tests/integration/conftest.py detached them): where each was stuck
      echo "== $part: tasks left by a test that did not end when cancelled (detached; see the warnings summary):"
      grep -A4 "STUCK TASK" "$log" | head -n 40
    fi
    rm -f "$log"
    if [ "$rc" -eq 0 ]; then rm -rf "$base"; else echo "== $part: its temporary files are in $base"; fi
    if [ "$attempt" -eq 1 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
      echo "== running $part once more"
      continue
    fi
    break
  done
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
