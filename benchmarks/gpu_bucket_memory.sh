#!/usr/bin/env bash
# reduce_bucket_size vs device memory under pipeline parallelism + ZeRO-1, on one NVIDIA GPU
# (1 stage, dp 1, `small` preset, bf16, torch Adam). Run from the repository root:
#     bash benchmarks/gpu_bucket_memory.sh [--quick] [OUT_DIR]
# Prints per-step reserved and peak memory (MiB) and samples/s for bucket 1e6 and 5e8.
# Measured on an H200 (README, "On a GPU"): 1e6 -> peak 118 MiB; 5e8 -> peak 1,999 MiB.
# --quick (CI): 2 steps per run. Without CUDA it says "not available on CPU" and exits 0.
# PYTHON=/path/to/python picks the interpreter (default python3).
set -u
PY=${PYTHON:-python3}
STEPS=4
if [ "${1:-}" = "--quick" ]; then STEPS=2; shift; fi
OUT=${1:-${OUT:-gpu-bucket-memory}}
mkdir -p "$OUT"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_bucket_memory: not available on CPU (no CUDA device); nothing measured"; exit 0
fi
fail=0
for b in 1000000 500000000; do
  "$PY" - "$b" > "$OUT/c$b.json" <<'PY'
import json, sys
print(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "train_batch_size": 32,
  "steps_per_print": 10**9, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
  "bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "reduce_bucket_size": int(sys.argv[1])}}))
PY
  # The rank script reads one trial description (autotune/workload/trial_spec.py), as in a tuning run.
  "$PY" -c "
import sys; from autotune.options import WorkloadOptions as W; from autotune.workload.trial_spec import TrialSpec as T
T(workload=W(preset='small', pipeline_stages=1, data_parallel_size=1, steps=int(sys.argv[1]), warmup_steps=1),
  trial=-1, ds_config='$OUT/c$b.json', metrics_csv='$OUT/b$b-{rank}.csv').write(__import__('pathlib').Path('$OUT/t$b.json'))
" "$STEPS" || fail=1
  timeout 60 "$PY" -m deepspeed.launcher.runner --num_gpus 1 --no_local_rank --master_port 2960${#b} autotune/workload/train.py --trial-spec "$OUT/t$b.json" > "$OUT/log$b.txt" 2>&1
  rc=$?
  echo "bucket $b rc $rc"
  [ "$rc" -eq 0 ] || fail=1
  "$PY" -c "
import csv,sys; rows=list(csv.DictReader(open('$OUT/b$b-0.csv')))
print(' reserved MiB', [round(float(r['memory_reserved_bytes'])/2**20) for r in rows], 'peak MiB', [round(float(r['memory_peak_bytes'])/2**20) for r in rows], 'sps', [round(float(r['samples_per_second'])) for r in rows])" || fail=1
done
exit $fail
