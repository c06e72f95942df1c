#!/usr/bin/env bash
# Proof that the test suite does not flake: run the whole suite N times in a row while
# BUSY other processes keep cores 100% busy, and print "N passed, M failed" totals.
#
#   bench/stress_suite.sh [N [BUSY]]   (defaults: N=5 runs, BUSY=2 busy processes)
#
# The pytest command is .ci/run's (compiled codec required), so the suite runs side by side
# in its default xdist workers (docs/testing.md); PYTEST_ADDOPTS="-n 8" stresses it on
# another number of workers. The venv is the repo's .venv unless STRESS_VENV names another
# (e.g. STRESS_VENV=.venv-ci after .ci/run).
# Each run's output goes to a log under STRESS_LOGS (default: a fresh mktemp dir); a
# failed run's summary lines are printed. Exits 1 when any run failed, 2 on bad usage.
#
# Why busy cores: the suite's races showed up only on a loaded 2-core machine, and one
# busy loop was not enough to show all of them (a run failed while two compilers and a
# busy loop shared the two cores), so the recorded run uses two. Each busy process is a
# shell busy loop (no extra tools needed), started here and always killed here, on
# normal exit, Ctrl-C or TERM alike. BUSY=0 runs the suite unloaded.
set -uo pipefail

usage="usage: $0 [N [BUSY]]  (N: how many full-suite runs, a positive integer, default 5; BUSY: how many busy processes load the cores meanwhile, a non-negative integer, default 2)"
if [[ $# -gt 2 ]]; then
    echo "$usage" >&2
    exit 2
fi
runs=${1:-5}
busy=${2:-2}
if ! [[ $runs =~ ^[1-9][0-9]*$ ]]; then
    echo "$usage" >&2
    echo "$0: N must be a positive integer, got '$runs'" >&2
    exit 2
fi
if ! [[ $busy =~ ^(0|[1-9][0-9]*)$ ]]; then
    echo "$usage" >&2
    echo "$0: BUSY must be a non-negative integer, got '$busy'" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
venv=${STRESS_VENV:-.venv}
python=$venv/bin/python
if [[ ! -x $python ]]; then
    echo "$0: no Python at $python (create the venv, or set STRESS_VENV)" >&2
    exit 2
fi
logs=${STRESS_LOGS:-$(mktemp -d -t stress_suite.XXXXXX)}
mkdir -p "$logs"

hogs=()
suite=""
cleanup() {
    if [[ -n $suite ]]; then
        kill -TERM -- "-$suite" 2>/dev/null  # the run's whole process group (tests start children)
        wait "$suite" 2>/dev/null
    fi
    local hog
    for hog in "${hogs[@]}"; do
        kill "$hog" 2>/dev/null
        wait "$hog" 2>/dev/null
    done
    suite=""
    hogs=()
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

# BUSY cores' worth of busy loops for as long as the runs take.
for ((b = 0; b < busy; b++)); do
    bash -c 'while :; do :; done' &
    hogs+=("$!")
done

export BRIDGE_REQUIRE_EXTENSIONS=1
echo "stress_suite: $runs full runs of the suite ($("$python" --version 2>&1), venv $venv${PYTEST_ADDOPTS:+, PYTEST_ADDOPTS=$PYTEST_ADDOPTS}), $busy busy process(es) (pids ${hogs[*]:-none}); logs in $logs"
passed=0
failed=0
started_all=$SECONDS
for ((i = 1; i <= runs; i++)); do
    log=$logs/run$i.log
    started=$SECONDS
    # in the background, in its own process group, and waited for: a signal to this
    # script stops the run and everything it started at once
    setsid "$python" -m pytest -q -p no:cacheprovider >"$log" 2>&1 &
    suite=$!
    wait "$suite"
    rc=$?
    suite=""
    took=$((SECONDS - started))
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error)[^=]* in [0-9.]+s' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    if [[ $rc -eq 0 ]]; then
        passed=$((passed + 1))
        echo "run $i/$runs: passed in ${took} s ($summary)"
    else
        failed=$((failed + 1))
        echo "run $i/$runs: FAILED (exit $rc) in ${took} s ($summary); log: $log"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    fi
done
echo "stress_suite: $runs runs in $((SECONDS - started_all)) s, $busy busy process(es)"
echo "stress_suite: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
