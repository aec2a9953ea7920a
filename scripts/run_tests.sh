#!/usr/bin/env bash
# The test suite as `make test` (and so CI) runs it: tests/e2e, tests/integration and tests/unit, each in a pytest
# process of its own, in two lanes that run side by side: e2e then unit, and integration. e2e and integration mostly
# wait on the processes they start (measured: 46% and 36% of one core over 364 s and 439 s), so side by side they
# take about the time of the longer lane instead of the sum (CI about 13 minutes instead of 19). A part that freezes
# whole, so that not even pytest-timeout's per-test alarm can run (a C-level deadlock inside a library, e.g. gRPC's
# GIL deadlock on channel close, grpc/grpc#42247), is stopped at its time limit with the servers it started (the
# tests' etcd runs in a session of its own), the innermost frames of each thread in its stack dumps are printed, and
# it runs once more. A part whose tests fail is not run again. Each run keeps its temporary files in a folder of its
# own, removed when it passes. A part's output is printed whole when it ends. Extra arguments go to every pytest run.
#   FLOWMAKER_TEST_PART_LIMIT  time limit of one run of a part (default 25m; each part takes 1-12 min here)
#   FLOWMAKER_TEST_LANES       the lanes, separated by '|', each a space-separated list of parts run one after
#                              another (default: "tests/e2e tests/unit|tests/integration")
#   FLOWMAKER_TEST_PARTS       the parts, space-separated, one after another in a single lane (overrides the lanes)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
limit=${FLOWMAKER_TEST_PART_LIMIT:-25m}
if [ -n "${FLOWMAKER_TEST_PARTS:-}" ]; then
  lanes=("$FLOWMAKER_TEST_PARTS")
else
  IFS='|' read -r -a lanes <<< "${FLOWMAKER_TEST_LANES:-tests/e2e tests/unit|tests/integration}"
fi
out=$(mktemp -d)  # the lanes' logs and exit statuses
lock="$out/print.lock"  # one part's output at a time on stdout

# run_part PART LOG: run one part (twice if it freezes) into LOG; returns its pytest status.
run_part() {
  local part=$1 log=$2 attempt base rc
  shift 2
  for attempt in 1 2; do
    # The run's temporary files in a folder of its own: the servers the tests start keep their data there (etcd's
    # --data-dir), which names them below if the run freezes.
    base=$(mktemp -d)
    # timeout runs pytest in a process group of its own and signals the whole group: the servers it started go too
    timeout -k 30 "$limit" "$PY" -m pytest -q "$part" --basetemp "$base" "$@" > "$log.run" 2>&1
    rc=$?
    cat "$log.run" >> "$log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "== FROZEN: $part gave no result within $limit (run $attempt of 2); innermost frames of each thread:" >> "$log"
      awk '/^(Thread|Current thread) 0x/ {print; n=4; next} n > 0 && /^  File/ {print; n--}' "$log.run" \
        | tail -n 60 >> "$log"
      # what escaped the group (a server in a session of its own, as the tests' etcd is) and still runs: with its
      # data in this run's folder (not by this checkout's interpreter: the other lane's pytest runs it too)
      pkill -KILL -f "$base" 2>/dev/null || true
    fi
    if grep -q "STUCK TASK" "$log.run"; then
      # tasks a test left that would not end (tests/integration/conftest.py detached them): where each was stuck
      { echo "== $part: tasks left by a test that did not end when cancelled (detached; see the warnings summary):"
        grep -A4 "STUCK TASK" "$log.run" | head -n 40; } >> "$log"
    fi
    rm -f "$log.run"
    if [ "$rc" -eq 0 ]; then rm -rf "$base"; else echo "== $part: its temporary files are in $base" >> "$log"; fi
    if [ "$attempt" -eq 1 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
      echo "== running $part once more" >> "$log"
      continue
    fi
    break
  done
  return "$rc"
}

# run_lane I PARTS...: each part in turn; prints each part's output when it ends; records the lane's status.
run_lane() {
  local i=$1 part log status=0 t0 rc
  shift
  for part in "$@"; do
    log="$out/$(echo "$part" | tr '/' '_').log"
    : > "$log"
    t0=$SECONDS
    echo "== $part: started"
    run_part "$part" "$log" "${extra[@]}"
    rc=$?
    flock "$lock" sh -c 'echo "== $1 (exit $2, $3 s):"; cat "$4"' _ "$part" "$rc" "$((SECONDS - t0))" "$log"
    [ "$rc" -eq 0 ] || status=1
  done
  echo "$status" > "$out/lane$i.status"
}

extra=("$@")
pids=()
for i in "${!lanes[@]}"; do
  read -r -a parts <<< "${lanes[$i]}"
  echo "== lane $i: ${parts[*]}"
  run_lane "$i" "${parts[@]}" &
  pids+=($!)
done
wait "${pids[@]}"
status=0
for i in "${!lanes[@]}"; do
  [ "$(cat "$out/lane$i.status" 2>/dev/null)" = "0" ] || status=1
done
rm -rf "$out"
exit "$status"
