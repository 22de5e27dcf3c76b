#!/usr/bin/env bash
# The one-GPU checks of README "On one GPU", sized for a session's 15 minutes of device time, the machine's start
# included: two device calls of ~4.5 and ~5 minutes, the second made at once after the first (a machine stays warm
# ~30 s after a call; a new start costs 1-2 minutes).
#
#   bash gpu_check.sh check   # call 1 (timeout_s 420): the GPU tests, the toy run in fp32 and in bf16, the GPU
#                             # bench on its tiny shape, and every eager decode step timed per policy (~270 s)
#   bash gpu_check.sh bench   # call 2 (timeout_s 420): python bench.py --gpu, the 1.7B-shaped bench (~300 s)
#   DEVICE=cpu bash gpu_check.sh check bench   # here, on the CPU at toy sizes (~1.5 min): checks this script
#                                               # (tests/test_gpu_check.py runs it so, the GPU tests stubbed)
#
# Each stage runs under its own time limit, cut to what is left of the call's CALL seconds (default 400, inside
# the device call's timeout_s), and writes one file to $OUT (the device tool's folder; out/gpu-check where it is
# unset), so a stage that fails or runs long costs only itself. A stage past its limit gets SIGINT (Ctrl-C: pytest
# prints its summary, the bench writes its targets and JSON), then SIGKILL 15 s later; its exit code is 124.
# summary_<steps>.txt says what ran where, each stage's exit code and seconds; the end of the output is a digest
# of what each stage measured. At most 6 files a call (the device tool returns 8). After the calls: copy
# bench_gpu.{md,json,log}, train_gpu_{fp32,bf16}.txt and step_times.txt into results/.
set -uo pipefail
cd "$(dirname "$0")"
[ $# -gt 0 ] || { echo "usage: bash gpu_check.sh check|bench ... (DEVICE=cpu: toy sizes on the CPU)" >&2; exit 2; }
for step in "$@"; do
    case $step in check|bench) ;; *) echo "unknown step '$step': check or bench" >&2; exit 2 ;; esac
done

DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}                      # the GPU image's python3 holds torch; a plain `python` may not exist there
OUT=${OUT:-out/gpu-check}
CALL=${CALL:-400}                      # seconds this call may take in all (the device call: timeout_s 420)
WORK=$(mktemp -d)                      # the training runs' folders and the quick bench's tables: not returned
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1              # a stage cut off at its limit keeps what it printed
mkdir -p "$OUT"
SUMMARY="$OUT/summary_$(IFS=_; echo "$*").txt"
FAILED=()

# Every array holds something on both devices: an empty "${a[@]}" fails under `set -u` in bash before 4.4.
if [ "$DEVICE" = cuda ]; then          # the README's commands, as they are
    TESTS=(env "$PY" -m pytest)        # (GPU_TESTS_DEVICE unset: the tests run on CUDA), in 4 processes where
    "$PY" -c "import xdist" 2>/dev/null && TESTS+=(-n 4)   # pytest-xdist is (the GPU image has it): ~1 minute less
    TRAIN=(--device cuda)              # the quick start's run: 100 warm-up steps, 200 RL steps
    STEPS=(--device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 320 --budget 512 --interval 128)
    BENCH=(--gpu)
else                                   # the same commands at toy sizes, to check this script on a CPU
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # beside another job on 2 cores, 2 threads ran 4.5x slower (README)
    TESTS=(env GPU_TESTS_DEVICE=cpu "$PY" -m pytest)
    TRAIN=(--device cpu --steps 4 --warmup-steps 4 --eval-size 8 --eval-every 4)
    STEPS=(--device cpu --shape layers28 --batch 4 --prompt 32 --new 48 --budget 16 --interval 16)
    BENCH=(--gpu --quick)
fi

stage() {   # stage NAME LIMIT COMMAND...: COMMAND's output in $OUT/NAME, its exit code and seconds in the summary
    local name=$1 limit=$2 left=$((CALL - SECONDS - 20)) start=$SECONDS rc; shift 2   # 20 s: SIGKILL's grace, digest
    if [ "$left" -lt 10 ]; then
        echo "$(date +%T) $name: not run, $SECONDS of the call's $CALL s spent" | tee -a "$SUMMARY"
        FAILED+=("$name")
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "$(date +%T) $name: $*" | tee -a "$SUMMARY"
    timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name" 2>&1
    rc=$?
    echo "$(date +%T) $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$SUMMARY"
    [ $rc = 0 ] || FAILED+=("$name")
}

machine() {   # the device, the versions and the time, first in the summary and on the screen
    { date -u
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
      "$PY" -c "import torch, transformers as t; print('torch', torch.__version__, 'transformers', t.__version__,
                'CUDA device:', torch.cuda.is_available() and torch.cuda.get_device_name())"
    } 2>&1 | tee -a "$SUMMARY"
}

check() {   # the GPU tests, the toy run twice, the tiny GPU bench, each eager decode step of five policies timed
    stage test_gpu.txt 180 "${TESTS[@]}" -vv -rfEs -p no:cacheprovider tests/test_gpu.py
    stage train_gpu_fp32.txt 120 "$PY" train.py "${TRAIN[@]}" --out "$WORK/fp32"
    stage train_gpu_bf16.txt 120 "$PY" train.py "${TRAIN[@]}" --dtype bfloat16 --out "$WORK/bf16"
    stage bench_quick.txt 60 "$PY" bench.py --gpu --quick --out "$WORK/quick.md"
    stage step_times.txt 150 "$PY" static.py "${STEPS[@]}" --rounds 1 --policies full,streaming,snapkv,rkv,h2o \
        --step-times
}

bench() {   # tables 1-4 and the targets; bench_gpu.py begins no row after its deadline (300 s), so it ends by ~370 s
    stage bench_gpu.log 380 "$PY" bench.py "${BENCH[@]}" --out "$OUT/bench_gpu.md"
}

digest() {   # what each stage measured, last on the screen: the device tool's reply carries the output's end
    local f
    for f in "$OUT"/test_gpu.txt "$OUT"/train_gpu_*.txt "$OUT"/step_times.txt "$OUT"/bench_gpu.md; do
        [ -f "$f" ] || continue
        echo "== $(basename "$f")"
        case $f in   # each with its last lines where what it looks for is not there (a stage cut short)
            *test_gpu.txt) grep -E "^(FAILED|ERROR)| (passed|failed|error)" "$f" | tail -n 20 || tail -n 5 "$f" ;;
            *train_gpu_*) grep -E "^\||^peak KV|^the correction|^training reward|^wall time" "$f" || tail -n 5 "$f" ;;
            *step_times.txt) tail -n 6 "$f" ;;
            *bench_gpu.md) echo "rows skipped past the deadline: $(grep -c "skipped: past the deadline" "$f")"
                           sed -n '/^### Targets/,$p' "$f" ;;
        esac
    done
}

machine
for step in "$@"; do "$step"; done
digest
echo "$(date +%T) done in $SECONDS s: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$SUMMARY"
[ ${#FAILED[@]} = 0 ] || { echo "failed: ${FAILED[*]} (see each file in $OUT)" | tee -a "$SUMMARY" >&2; exit 1; }
