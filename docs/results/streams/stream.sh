#!/bin/bash
# streamed vs windowed test bpb: text-default budget, AFT models with positional none
cd /work/wt/r22-train
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src
PY=/work/main/.venv/bin/python
while pgrep -f runs/r22/pack.sh > /dev/null; do sleep 20; done
run() {  # name, extra train args...
  name=$1; shift
  out=runs/r22/stream-$name
  if [ ! -f $out/summary.json ]; then
    s=$(date +%s)
    $PY -m aftlab train --config configs/text-default.toml --set device=cpu --set sample_tokens=0 --out $out "$@" > $out.train.log 2>&1
    echo "$name train_wall=$(( $(date +%s) - s ))s" >> runs/r22/stream.results
  fi
  s=$(date +%s); $PY -m aftlab eval $out --split test --device cpu > $out.windowed.txt 2>&1
  echo "$name windowed_wall=$(( $(date +%s) - s ))s $(cat $out.windowed.txt)" >> runs/r22/stream.results
  s=$(date +%s); $PY -m aftlab eval $out --split test --device cpu --stream > $out.stream.txt 2>&1
  echo "$name stream_wall=$(( $(date +%s) - s ))s $(cat $out.stream.txt)" >> runs/r22/stream.results
}
run attention --mixer attention
run aft-simple --mixer aft-simple --set model.positional=none
run aft-decay --mixer aft-decay --set model.positional=none
run aft-conv --mixer aft-conv --set model.positional=none
run aft-local --mixer aft-local --set model.positional=none
run aft-decay-carried --mixer aft-decay --set model.positional=none --set carry_state=true
