#!/usr/bin/env bash
# The CUDA paths in one go, for a machine with a GPU: the suite's `cuda` tests, training in the precision `auto`
# picks there with NVML telemetry, a compiled training step, torchrun (NCCL) with its rerun skipped, the decode
# benchmark with the step compiled to CUDA graphs, the training-step benchmark, and a task run scored on the GPU.
# Every step runs even when one before it failed; the end lists each step's exit status and what results.db
# recorded (device, precision, compilation, memory, NVML), so one run of this script is the whole check.
#
#   bash benchmarks/gpu_check.sh DATA_DIR WORK_DIR [STEPS]
#
# DATA_DIR holds TinyStories' train.txt and valid.txt; WORK_DIR receives results.db (the cache goes to a temporary
# folder); STEPS (default 200) is the optimizer steps of each training run. Run from the repository's root.
set -u
DATA=${1:?usage: gpu_check.sh DATA_DIR WORK_DIR [STEPS]}
WORK=${2:?usage: gpu_check.sh DATA_DIR WORK_DIR [STEPS]}
STEPS=${3:-200}
WARMUP=$((STEPS < 10 ? STEPS : 10))
PY=${PYTHON:-python3}
mkdir -p "$WORK"
DB=$WORK/results.db
export BENCHCTL_CACHE=${BENCHCTL_CACHE:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
B=("$PY" -m benchctl)
COMMON=(--preset tiny --data "$DATA" --db "$DB" --no-progress)
STATUS=()

step() {
    local name=$1
    shift
    echo
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout ${STEP_TIMEOUT:-300} "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    STATUS+=("$name: exit $rc, $((SECONDS - t0)) s")
}

step machine bash -c "nvidia-smi -L; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())'"

step cuda-tests env BENCHCTL_TEST_DATA="$DATA" "$PY" -m pytest -q -p no:cacheprovider -n 0 -m cuda \
    tests/test_architectures.py tests/test_sample.py tests/test_train.py

step train "${B[@]}" train-all --archs control,three-part,relaxed "${COMMON[@]}" \
    --set train.max_steps="$STEPS" --set train.warmup_steps="$WARMUP"

step train-compiled "${B[@]}" train --arch three-part --seed 1 "${COMMON[@]}" --set train.compile=true \
    --set train.max_steps="$STEPS" --set train.warmup_steps="$WARMUP"

TORCHRUN=(torchrun --standalone --nproc_per_node 1 -m benchctl train --arch control --seed 2 "${COMMON[@]}"
    --set train.max_steps="$STEPS" --set train.warmup_steps="$WARMUP")
step torchrun "${TORCHRUN[@]}"
step torchrun-rerun "${TORCHRUN[@]}"

step decode "${B[@]}" bench --decode --compile --preset tiny --archs control,three-part --batches 1,16 \
    --db "$DB" --json

step train-bench "${B[@]}" bench --preset paper --archs control,three-part --steps 5 --repeats 2 --db "$DB" --json

step task-train "${B[@]}" train --arch control --task addition --preset tiny --db "$DB" --no-progress \
    --set train.max_steps="$STEPS" --set train.warmup_steps="$WARMUP"
step task-accuracy "${B[@]}" accuracy --archs control --preset tiny --problems 50 --depths 1 --device cuda \
    --db "$DB" --no-progress --yes

echo
echo "=== what results.db recorded"
"$PY" - "$DB" <<'EOF'
import sqlite3, sys

con = sqlite3.connect(sys.argv[1])
con.row_factory = sqlite3.Row
for table, cols in [
    ("runs", "arch, seed, status, device, dtype, compile_reason, world_size, final_val_loss, tokens_per_s, "
     "step_seconds, peak_gpu_mem_bytes, peak_gpu_reserved_bytes, peak_nvml_mem_bytes, gpu_telemetry_note, "
     "driver_version, cuda_version, torch_version"),
    ("bench", "*"),
    ("accuracy_results", "*"),
]:
    try:
        rows = con.execute(f"select {cols} from {table}").fetchall()
    except sqlite3.Error as e:
        print(f"{table}: {e}")
        continue
    print(f"--- {table}: {len(rows)} rows")
    for r in rows:
        print({k: r[k] for k in r.keys() if r[k] is not None})
EOF

echo
echo "=== steps"
printf '%s\n' "${STATUS[@]}"
