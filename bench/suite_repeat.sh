#!/usr/bin/env bash
# The whole test suite, N times in a row in each of three conditions, on a
# fresh clone of this repository's HEAD (built in place, imported through
# PYTHONPATH, so the installed copy is not touched); one line per run.
#
#   bash bench/suite_repeat.sh [N=20] [MODES="plain onecpu loaded"]
#
#   plain   as it comes
#   onecpu  taskset -c $ONECPU (default 0): the tests, engines and clients all
#           on one CPU (two such runs side by side: ONECPU=0 ... & ONECPU=1 ...)
#   loaded  beside two busy loops that keep both (or the first two) cores busy
set -uo pipefail
N=${1:-20}
MODES=${2:-"plain onecpu loaded"}
here=$(cd "$(dirname "$0")/.." && pwd)
clone=$(mktemp -d /tmp/shmbatch-suite.XXXXXX)
busy=()
cleanup() { [ ${#busy[@]} -gt 0 ] && kill "${busy[@]}" 2>/dev/null; rm -rf "$clone"; }
trap cleanup EXIT
git clone -q "$here" "$clone" && (cd "$clone" && python csrc/build_ring.py >/dev/null 2>&1) || {
    echo "could not clone and build $here"; exit 1; }
echo "suite of $(git -C "$clone" log -1 --format='%h %s' | cut -c1-72)"
failed=0
for mode in $MODES; do
    for i in $(seq 1 "$N"); do
        prefix=()
        if [ "$mode" = onecpu ]; then prefix=(taskset -c "${ONECPU:-0}"); fi
        if [ "$mode" = loaded ]; then
            for c in 0 1; do taskset -c "$c" sh -c 'while :; do :; done' & busy+=($!); done
        fi
        start=$(date +%s)
        log=$(cd "$clone" && PYTHONPATH="$clone" "${prefix[@]}" python -m pytest -q -rf -p no:cacheprovider 2>&1)
        line=$(tail -1 <<<"$log")
        if [ ${#busy[@]} -gt 0 ]; then kill "${busy[@]}" 2>/dev/null; wait "${busy[@]}" 2>/dev/null; busy=(); fi
        [[ "$line" == *failed* || "$line" == *error* ]] && failed=$((failed + 1))
        printf '%-6s %2d/%d %4ds  %s\n' "$mode" "$i" "$N" "$(( $(date +%s) - start ))" "$line"
        grep '^FAILED\|^ERROR' <<<"$log" | sed 's/^/    /'
    done
done
echo "runs with a failure: $failed"
[ "$failed" -eq 0 ]
