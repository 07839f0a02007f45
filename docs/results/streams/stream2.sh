#!/bin/bash
cd /work/wt/r22-train
while pgrep -f "runs/r22/pack2.sh" > /dev/null; do sleep 20; done
source <(sed -n '/^export/,/^}/p' runs/r22/stream.sh)
run aft-local-relative --mixer aft-local --set mixer_options.relative_bias=true --set model.positional=none
run aft-simple-carried --mixer aft-simple --set model.positional=none --set carry_state=true
