#!/usr/bin/env bash
# On a CUDA machine (one GPU, within 10 minutes), everything under OUT_DIR:
#   1. the Triton kernels' tests, compiled on CUDA tensors (not the interpreter): triton-tests.txt
#   2. the benchmark of run_cpu.sh on the GPU (peak memory from the CUDA allocator)
#   bash benchmarks/run_cuda.sh [OUT_DIR]   (default: $OUT, else docs/benchmarks-cuda)
# aftlab need not be installed: it runs from this checkout (PYTHONPATH=src) with the machine's
# python3 (PYTHON), which must hold torch with CUDA, triton and pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-docs/benchmarks-cuda}}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())' \
    || exit 1
"$PY" -m pytest -q -p no:cacheprovider -k triton \
    tests/kernels/test_triton.py tests/ops/test_aft_simple.py tests/ops/test_aft_decay.py \
    2>&1 | tee "$OUT/triton-tests.txt"
tests=$?
"$PY" -m aftlab.bench \
  --mixers aft-simple,aft-decay,aft-local,aft-conv,attention,aft-full,attention-naive \
  --lengths 256,1024,2048,4096,16384 \
  --decode-positions 128,1024,4096,16384 \
  --batch 4 --dim 256 --heads 4 \
  --causal --also-noncausal aft-full \
  --device cuda --dtype float32 \
  --repeats 10 --max-seconds-per-case 30 \
  --peers aft-pytorch,hf-rwkv --compare-lengths 256,1024,4096 \
  --out "$OUT"
bench=$?
echo "run_cuda: triton tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
