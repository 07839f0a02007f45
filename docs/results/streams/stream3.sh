#!/bin/bash
# the streamed evaluations again, with the one-pass state continuation merged from main
cd /work/wt/r22-train
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src
PY=/work/main/.venv/bin/python
while pgrep -f "runs/r22/(pack2|stream2).sh" > /dev/null; do sleep 20; done
for name in aft-simple aft-decay aft-conv aft-decay-carried; do
  out=runs/r22/stream-$name
  s=$(date +%s); $PY -m aftlab eval $out --split test --device cpu --stream > $out.stream2.txt 2>&1
  echo "$name stream_onepass_wall=$(( $(date +%s) - s ))s $(cat $out.stream2.txt)" >> runs/r22/stream.results
done
