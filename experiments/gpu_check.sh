#!/usr/bin/env bash
# The GPU check: every CUDA figure funcshard has comes from this script.
#
#   experiments/gpu_check.sh            # on a GPU machine: results and logs under $OUT
#   experiments/gpu_check.sh --dry-run  # here, on the CPU: the same steps on a tiny model
#
# Sized for a session lent a GPU (15 minutes of device time, 10 a command): each part has its
# own time limit (under 12 minutes in all), so one that hangs costs its limit, not the run.
# Parts: the machine (nvidia-smi, torch), the CUDA tests (`pytest -m cuda`), bench_step on a
# 0.34B GPT (d_model 1024, 24 layers, batch 4 x 1024 tokens, 2 microbatches: funcshard ZeRO-3 /
# ZeRO-2 beside FSDP2 and plain torch, bf16 compute, one GPU; the three runners' states sit
# side by side on the card, and at 0.73B they do not fit in 80 GB), then the offload rows on a
# 0.73B GPT (fraction 0.5 and 1, FSDP2's CPUOffloadPolicy beside) with a profiler trace of one
# step (the copies on their side streams), then checkpoint save / restore beside DCP. Python
# packages missing on the device image (optree, crc32c) come as wheels in .whl (BUILD.md, "GPU").
# The compile part: bench_step --compile=inductor on a 0.19B GPT (12 layers of the step part's),
# funcshard's compiled blocks and fs.init(compile=) (the captured step; on CUDA also with
# cuda_graphs=True) beside FSDP2's compiled blocks and torch.compile(model), each beside its
# eager run. PARTS (default: all, in order) picks parts where device time is short, e.g.
#   PARTS="machine cuda_tests compile step" experiments/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT="${OUT:-out/gpu_check}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
PY="${PYTHON:-python3}"
[[ $DRY == 1 && -x .venv/bin/python ]] && PY=.venv/bin/python

if [[ $DRY == 0 && -d .whl ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$LOGS/pip.log" 2>&1 || { cat "$LOGS/pip.log"; exit 1; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

# part NAME LIMIT_S CMD...: runs CMD under a time limit, its log in $LOGS/NAME.log; the summary
# gets the command, its status and seconds, and the log's last lines (the result tables).
PARTS="${PARTS:-machine cuda_tests step compile offload offload_all checkpoint}"
part() {
  local name=$1 limit=$2
  shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  local start=$SECONDS rc
  echo "== $name: $*" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "   $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$SUMMARY"
  grep -v '^USDT' "$LOGS/$name.log" | tail -n 25 | tee -a "$SUMMARY"
}

if [[ $DRY == 1 ]]; then
  DEV=cpu
  MODEL=(--d_model=64 --n_layer=2 --seq_len=32 --vocab=256 --batch=2)
  STEPS=(--steps=2 --warmup=1)
  STEP_MODEL=("${MODEL[@]}")
  TESTS=(tests/test_offload.py -k "cuda or matches")
  COMPILE_MODEL=("${MODEL[@]}")
  COMPILE_MODES=blocks,fs
else
  DEV=cuda
  MODEL=(--d_model=1536 --n_layer=24 --seq_len=1024 --vocab=32768 --batch=8)
  STEP_MODEL=(--d_model=1024 --n_layer=24 --seq_len=1024 --vocab=32768 --batch=4)
  STEPS=(--steps=5 --warmup=2)
  TESTS=(-m cuda tests)
  COMPILE_MODEL=(--d_model=1024 --n_layer=12 --seq_len=1024 --vocab=32768 --batch=4)
  COMPILE_MODES=blocks,fs,cuda_graphs
fi

part machine 60 bash -c "nvidia-smi 2>&1 | head -20; lscpu | grep -E 'Model name|^CPU\(s\)'; \
  $PY -c 'import torch; print(torch.__version__, torch.version.cuda, \
  torch.cuda.get_device_name() if torch.cuda.is_available() else \"no cuda\")'"
part cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
part step 150 "$PY" experiments/bench_step.py --device=$DEV --nproc=1 --policies=bf16 \
  --bf16_anyway --microbatches=2 "${STEP_MODEL[@]}" "${STEPS[@]}"
part compile 240 env TORCHINDUCTOR_CACHE_DIR=/tmp/inductor "$PY" experiments/bench_step.py \
  --device=$DEV --nproc=1 --policies=bf16 --bf16_anyway --microbatches=2 --compile=inductor \
  --compile_modes=$COMPILE_MODES "${COMPILE_MODEL[@]}" "${STEPS[@]}"
part offload 120 "$PY" experiments/bench_step.py --device=$DEV --nproc=1 --policies=bf16 \
  --bf16_anyway --microbatches=2 --strategies=optim_grads_params --offload_fraction=0.5 \
  --trace_dir="$LOGS" "${MODEL[@]}" --steps=3 --warmup=1
part offload_all 150 "$PY" experiments/bench_step.py --device=$DEV --nproc=1 --policies=bf16 \
  --bf16_anyway --microbatches=2 --strategies=optim_grads_params --offload_fraction=1 \
  "${MODEL[@]}" --steps=2 --warmup=1
part checkpoint 75 "$PY" experiments/bench_checkpoint.py --device=$DEV --nproc=1 --reps=2 \
  --parts=dcp,hf
# What comes back from a device machine is a few files: the summary, the traces and the logs.
gzip -f "$LOGS"/*.json 2>/dev/null && mv "$LOGS"/*.json.gz "$OUT"/
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"
echo "summary: $SUMMARY; traces and logs.tgz beside it" | tee -a "$SUMMARY"
