#!/usr/bin/env bash
# Rerun one section of docs/results.md from scratch: its shell blocks' commands, in order, each
# echoed with its start time (benchmarks/results_commands.py extracts them).
#
#   bash benchmarks/reproduce.sh --list                  # the sections
#   bash benchmarks/reproduce.sh "aft-local's window"    # one section (a heading, or part of one)
#   bash benchmarks/reproduce.sh window --continue       # continue --out folders that exist
#
# Run from the repository root with aftlab on PATH (`make .venv/.test-installed`, then
# `. .venv/bin/activate`). A section whose --out folders exist is refused unless --continue.
# Measure on an idle machine (docs/benchmarks.md); each command says how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [[ "${1:-}" == "--list" || $# -eq 0 ]]; then exec "$PY" benchmarks/results_commands.py --list; fi
lines=$("$PY" benchmarks/results_commands.py "$@")
while IFS= read -r cmd; do
  [[ -z "$cmd" ]] && continue
  echo "+ $cmd   ($(date -u +%H:%M:%S) UTC)"
  start=$SECONDS
  bash -c "$cmd" </dev/null
  echo "+ done in $((SECONDS - start)) s"
done <<< "$lines"
