#!/usr/bin/env bash
# The full CPU benchmark of docs/benchmarks.md: B=4, d=256, float32, 2 threads, causal
# (plus non-causal aft-full), T = 256..16384, decoding steps at 128..16384, and the
# comparison with aft-pytorch. About 12-15 minutes on 2 otherwise idle cores; every case is
# bounded by --max-seconds-per-case. Run from the repository root:
#   bash benchmarks/run_cpu.sh [OUT_DIR]     (default OUT_DIR: docs/benchmarks)
set -euo pipefail
OUT="${1:-docs/benchmarks}"
exec python -m aftlab.bench \
  --lengths 256,1024,2048,4096,16384 \
  --decode-positions 128,1024,4096,16384 \
  --batch 4 --dim 256 --heads 4 \
  --causal --also-noncausal aft-full \
  --device cpu --dtype float32 --threads 2 \
  --repeats 5 --max-seconds-per-case 60 \
  --compare-aft-pytorch --compare-lengths 256,1024,4096 \
  --out "$OUT"
