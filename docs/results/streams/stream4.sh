#!/bin/bash
cd /work/wt/r22-train
source <(sed -n '/^export/,/^}/p' runs/r22/stream.sh)
run aft-decay-carried-onepass --mixer aft-decay --set model.positional=none --set carry_state=true
