#!/usr/bin/env bash
# The full CPU benchmark of docs/benchmarks.md: B=4, d=256, float32, 2 threads, causal
# (plus non-causal aft-full), T = 256..16384, decoding steps at 128..16384, and the peers:
# aft-pytorch and transformers' RWKV CPU path (each skipped with a note if not installed).
# About 15-20 minutes on 2 otherwise idle cores: every case is bounded by
# --max-seconds-per-case, and cases still to run after 18 minutes are skipped with a note (the
# mixers run in the order given, the cheap AFT ones first, the peers last). From the repo root:
#   bash benchmarks/run_cpu.sh [OUT_DIR]     (default OUT_DIR: docs/benchmarks)
set -euo pipefail
OUT="${1:-docs/benchmarks}"
exec python -m aftlab.bench \
  --mixers aft-simple,aft-decay,aft-local,aft-conv,attention,aft-full,attention-naive \
  --lengths 256,1024,2048,4096,16384 \
  --decode-positions 128,1024,4096,16384 \
  --batch 4 --dim 256 --heads 4 \
  --causal --also-noncausal aft-full \
  --device cpu --dtype float32 --threads 2 \
  --repeats 3 --max-seconds-per-case 60 --max-total-minutes 18 \
  --peers aft-pytorch,hf-rwkv --compare-lengths 256,1024,2048,4096 \
  --out "$OUT"
