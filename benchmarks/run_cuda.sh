#!/usr/bin/env bash
# The same benchmark as run_cpu.sh on a CUDA device (peak memory from the CUDA allocator).
#   bash benchmarks/run_cuda.sh [OUT_DIR]     (default OUT_DIR: docs/benchmarks-cuda)
set -euo pipefail
OUT="${1:-docs/benchmarks-cuda}"
exec python -m aftlab.bench \
  --mixers aft-simple,aft-decay,aft-local,aft-conv,attention,aft-full,attention-naive \
  --lengths 256,1024,2048,4096,16384 \
  --decode-positions 128,1024,4096,16384 \
  --batch 4 --dim 256 --heads 4 \
  --causal --also-noncausal aft-full \
  --device cuda --dtype float32 \
  --repeats 10 --max-seconds-per-case 30 \
  --peers aft-pytorch,hf-rwkv --compare-lengths 256,1024,4096 \
  --out "$OUT"
