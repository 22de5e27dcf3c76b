#!/usr/bin/env bash
# The one-GPU checks of README "On one GPU", sized for a session's 15 minutes of device time: two device calls
# of about 5 minutes each, the second made at once after the first (a machine stays warm ~30 s after a call).
#
#   bash gpu_check.sh check   # call 1 (timeout_s 420): the GPU, the GPU tests, the toy run in fp32 and in bf16,
#                             # the GPU bench on its tiny shape, and every eager decode step timed per policy
#   bash gpu_check.sh bench   # call 2 (timeout_s 420): python bench.py --gpu, the 1.7B-shaped bench (~4.5 min)
#   DEVICE=cpu bash gpu_check.sh check bench   # here, on the CPU at toy sizes (~1.5 min): checks this script
#                                               # (tests/test_gpu_check.py runs it so, the GPU tests stubbed)
#
# Each stage runs under its own time limit and writes one file to $OUT (the device tool's folder; out/gpu-check
# where it is unset), so a stage that fails or runs long costs only itself. summary.txt says what ran where, each
# stage's exit code (124: past its limit) and seconds. At most 6 files a call: the device tool returns 8.
# After the calls: copy bench_gpu.{md,json,log}, train_gpu_{fp32,bf16}.txt and step_times.txt into results/.
set -uo pipefail
cd "$(dirname "$0")"
[ $# -gt 0 ] || { echo "usage: bash gpu_check.sh check|bench ... (DEVICE=cpu: toy sizes on the CPU)" >&2; exit 2; }
for step in "$@"; do
    case $step in check|bench) ;; *) echo "unknown step '$step': check or bench" >&2; exit 2 ;; esac
done

DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}                      # the GPU image's python3 holds torch; a plain `python` may not exist there
OUT=${OUT:-out/gpu-check}
WORK=$(mktemp -d)                      # the training runs' folders and the quick bench's tables: not returned
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1              # a stage cut off at its limit keeps what it printed
mkdir -p "$OUT"
FAILED=()

if [ "$DEVICE" = cuda ]; then          # the settings of the README's commands
    TESTS=(env)
    TRAIN=()
    STEPS=(--shape qwen3-1.7b --batch 64 --prompt 512 --new 320 --budget 512 --interval 128)
    BENCH=()
else                                   # the same commands at toy sizes, to check this script on a CPU
    TESTS=(env GPU_TESTS_DEVICE=cpu)
    TRAIN=(--steps 4 --warmup-steps 4 --eval-size 8 --eval-every 4)
    STEPS=(--shape layers28 --batch 4 --prompt 32 --new 48 --budget 16 --interval 16)
    BENCH=(--quick)
fi

stage() {   # stage NAME LIMIT COMMAND...: COMMAND's output in $OUT/NAME, its exit code and seconds in summary.txt
    local name=$1 limit=$2 start rc; shift 2
    start=$(date +%s%N)
    echo "$(date +%T) $name: $*" | tee -a "$OUT/summary.txt"
    timeout "$limit" "$@" > "$OUT/$name" 2>&1
    rc=$?
    echo "$(date +%T) $name: exit $rc after $((($(date +%s%N) - start) / 1000000000)) s (limit $limit s)" |
        tee -a "$OUT/summary.txt"
    [ $rc = 0 ] || FAILED+=("$name")
}

machine() {   # the device, the versions, and the time, at the top of summary.txt
    { date -u
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
      "$PY" -c "import torch, transformers as t; print('torch', torch.__version__, 'transformers', t.__version__,
                'CUDA device:', torch.cuda.is_available() and torch.cuda.get_device_name())"
    } >> "$OUT/summary.txt" 2>&1
}

check() {   # the GPU tests, the toy run twice, the tiny GPU bench, each eager decode step of five policies timed
    stage test_gpu.txt 240 "${TESTS[@]}" "$PY" -m pytest -v -rfEs -p no:cacheprovider tests/test_gpu.py
    stage train_gpu_fp32.txt 150 "$PY" train.py --device "$DEVICE" "${TRAIN[@]}" --out "$WORK/fp32"
    stage train_gpu_bf16.txt 150 "$PY" train.py --device "$DEVICE" --dtype bfloat16 "${TRAIN[@]}" --out "$WORK/bf16"
    stage bench_quick.txt 90 "$PY" bench.py --gpu --quick --out "$WORK/quick.md"
    stage step_times.txt 180 "$PY" static.py --device "$DEVICE" "${STEPS[@]}" --rounds 1 \
        --policies full,streaming,snapkv,rkv,h2o --step-times
}

bench() {   # tables 1-4 and the targets; bench_gpu.py begins no row after its deadline (300 s), so it ends by ~370 s
    stage bench_gpu.log 400 "$PY" bench.py --gpu "${BENCH[@]}" --out "$OUT/bench_gpu.md"
}

digest() {   # what each stage measured, last on the screen: the device tool's reply carries the output's end
    local f
    for f in "$OUT"/test_gpu.txt "$OUT"/train_gpu_*.txt "$OUT"/step_times.txt "$OUT"/bench_gpu.md; do
        [ -f "$f" ] || continue
        echo "== $(basename "$f")"
        case $f in
            *test_gpu.txt) grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -n 20 ;;
            *train_gpu_*) grep -E "^\||^peak KV|^the correction|^training reward|^wall time|Error" "$f" ;;
            *step_times.txt) tail -n 6 "$f" ;;
            *bench_gpu.md) sed -n '/^### Targets/,$p' "$f" ;;
        esac
    done
}

machine
for step in "$@"; do "$step"; done
digest
echo "$(date +%T) done: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
[ ${#FAILED[@]} = 0 ] || { echo "failed: ${FAILED[*]} (see each file in $OUT)" | tee -a "$OUT/summary.txt" >&2; exit 1; }
