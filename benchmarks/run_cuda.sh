#!/usr/bin/env bash
# On a CUDA machine (one GPU, within 10 minutes), everything under OUT_DIR:
#   1. the Triton kernels' tests, compiled on CUDA tensors (not the interpreter): triton-tests.txt
#   2. the benchmark of run_cpu.sh on the GPU, with T = 8192 added (the aft-local target) and
#      the peers: SDPA (PyTorch's flash kernel) as attention, flash-linear-attention's
#      fused_recurrent_rwkv4 and fused_recurrent_hgrn (--peers fla), aft-pytorch, transformers'
#      RWKV; peak memory from the CUDA allocator; each case's floor from the measured GEMM rate
#      and device copy bandwidth ("time over floor"); the GPU targets checked in summary.md,
#      "Targets": bench.txt and the bench's report
#   3. training throughput and peak memory of aft-local (factorised and relative band) beside
#      attention's model at T = 4096 and 16384 (B = 1, d 256, 4 layers): train-T/ and train-T.txt
#   bash benchmarks/run_cuda.sh [OUT_DIR]   (default: $OUT, else docs/benchmarks-cuda)
# aftlab need not be installed: it runs from this checkout (PYTHONPATH=src) with the machine's
# python3 (PYTHON), which must hold torch with CUDA, triton and pytest (flash-linear-attention:
# optional, its rows are skipped with a note without it). Each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-docs/benchmarks-cuda}}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())' \
    || exit 1
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -k triton \
    tests/kernels/test_triton.py tests/ops/test_aft_simple.py tests/ops/test_aft_decay.py \
    tests/ops/test_aft_local.py tests/ops/test_aft_conv.py tests/ops/test_aft_full.py \
    tests/ops/test_large_values.py 2>&1 | tee "$OUT/triton-tests.txt"
tests=${PIPESTATUS[0]}
timeout 270 "$PY" -m aftlab.bench \
  --mixers aft-simple,aft-decay,aft-local,aft-conv,attention,aft-full,attention-naive \
  --lengths 256,1024,2048,4096,8192,16384 \
  --decode-positions 128,1024,4096,16384 \
  --batch 4 --dim 256 --heads 4 \
  --causal --also-noncausal aft-full \
  --device cuda --dtype float32 \
  --repeats 10 --max-seconds-per-case 20 --max-total-minutes 4 \
  --peers fla,aft-pytorch,hf-rwkv --compare-lengths 256,1024,4096 \
  --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
bench=${PIPESTATUS[0]}
train=0
for T in 4096 16384; do
  steps=$([ "$T" = 4096 ] && echo 12 || echo 4)
  timeout 60 "$PY" -m aftlab compare --task text \
    --mixers attention,aft-local,aft-local:relative_bias=true --steps "$steps" \
    --set seq_len="$T" --set batch_size=1 --set model.d_model=256 --set model.n_layers=4 \
    --set warmup=1 --set eval_interval=1000 --set eval_batches=1 --set test_batches=1 \
    --set eval_batch_size=1 --set checkpoint_interval=1000 --set device=cuda \
    --out "$OUT/train-$T" 2>&1 | tee "$OUT/train-$T.txt"
  train=$(( train || PIPESTATUS[0] ))
done
echo "run_cuda: triton tests exit $tests, bench exit $bench, training comparison exit $train"
exit $(( tests || bench || train ))
