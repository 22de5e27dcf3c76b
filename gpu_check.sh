#!/usr/bin/env bash
# The one-GPU checks of README "On one GPU", in ONE device call: a session has 15 minutes of device time, the
# machine's start (1-2 minutes) included, and a machine left idle for 30 s between two calls goes back (a new
# start: 1-2 minutes more). So one call of ~9 minutes (timeout_s 600) runs, most needed first:
#
#   bash gpu_check.sh      # tests: tests/test_gpu.py (~60-120 s); bench: python bench.py --gpu, the 1.7B-shaped
#                          # bench (~270 s on an H100, more on an H200's larger batches); train: the toy run in fp32
#                          # and in bf16 (~55 s each); steps: every eager decode step timed per policy (~90 s), in
#                          # what is left
#   bash gpu_check.sh train steps         # some of them, in the order given (a rerun on the machine still warm)
#   DEVICE=cpu bash gpu_check.sh          # here, on the CPU at toy sizes (~1.5 min): checks this script
#                                         # (tests/test_gpu_check.py runs it so, the GPU tests stubbed)
#
# Each stage runs under its own time limit, cut to what is left of the call's CALL seconds (default 575, inside
# the device call's timeout_s), and writes one file to $OUT (the device tool's folder; out/gpu-check where it is
# unset), so a stage that fails or runs long costs only itself; the bench is told to begin no row in the last
# 80 s of its limit (--deadline). A stage past its limit gets SIGINT (Ctrl-C: pytest prints its summary, the bench writes
# its targets and JSON), then SIGKILL 15 s later; its exit code is 124. summary.txt says what ran where, each
# stage's exit code and seconds; the end of the output is a digest of what each stage measured. 8 files, all
# that the device tool returns. After the call: copy bench_gpu.{md,json,log}, train_gpu_{fp32,bf16}.txt and
# step_times.txt into results/.
set -uo pipefail
cd "$(dirname "$0")"
STEPS=("$@")
[ $# -gt 0 ] || STEPS=(tests bench train steps)
for step in "${STEPS[@]}"; do
    case $step in
        tests|train|bench|steps) ;;
        *) echo "unknown step '$step': tests, train, bench or steps" >&2; exit 2 ;;
    esac
done

DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}                      # the GPU image's python3 holds torch; a plain `python` may not exist there
OUT=${OUT:-out/gpu-check}
CALL=${CALL:-575}                      # seconds this call may take in all (the device call: timeout_s 600)
# Refused here, before anything runs: any other DEVICE (cuda:0) ran the CPU's toy sizes on the GPU, and a CALL
# that is no number of seconds (480s) made every stage's time left an error: nothing ran, and the call exited 0.
[[ $DEVICE = cuda || $DEVICE = cpu ]] || { echo "DEVICE='$DEVICE': cuda (the default) or cpu" >&2; exit 2; }
[[ $CALL =~ ^[0-9]+$ ]] || { echo "CALL='$CALL': the call's seconds, a whole number (575 by default)" >&2; exit 2; }
WORK=$(mktemp -d)                      # the training runs' folders: not returned
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1              # a stage cut off at its limit keeps what it printed
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
FAILED=()

# Every array holds something on both devices: an empty "${a[@]}" fails under `set -u` in bash before 4.4.
if [ "$DEVICE" = cuda ]; then          # the README's commands, as they are
    TESTS=(env "$PY" -m pytest)        # (GPU_TESTS_DEVICE unset: the tests run on CUDA), in 4 processes where
    "$PY" -c "import xdist" 2>/dev/null && TESTS+=(-n 4)   # pytest-xdist is (the GPU image has it): ~1 minute less
    TRAIN=(--device cuda)              # the quick start's run: 100 warm-up steps, 200 RL steps
    TIMES=(--device cuda --shape qwen3-1.7b --batch 64 --prompt 512 --new 320 --budget 512 --interval 128)
    BENCH=(--gpu)
else                                   # the same commands at toy sizes, to check this script on a CPU
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # beside another job on 2 cores, 2 threads ran 4.5x slower (README)
    TESTS=(env GPU_TESTS_DEVICE=cpu "$PY" -m pytest)
    TRAIN=(--device cpu --steps 4 --warmup-steps 4 --eval-size 8 --eval-every 4)
    TIMES=(--device cpu --shape layers28 --batch 4 --prompt 32 --new 48 --budget 16 --interval 16)
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

tests() {   # the GPU tests
    stage test_gpu.txt 150 "${TESTS[@]}" -vv -rfEs -p no:cacheprovider tests/test_gpu.py
}

train() {   # the quick start's toy run, in fp32 and in bf16
    stage train_gpu_fp32.txt 100 "$PY" train.py "${TRAIN[@]}" --out "$WORK/fp32"
    stage train_gpu_bf16.txt 100 "$PY" train.py "${TRAIN[@]}" --dtype bfloat16 --out "$WORK/bf16"
}

bench() {   # tables 1-4 and the targets; no row begun in the last 80 s of its limit: the bench's clock starts
    local limit=$((CALL - SECONDS - 20))  # after its imports (~10 s), and its longest row took 35 s on an H100
    [ "$limit" -le 380 ] || limit=380     # (table 4's; on an H200, with twice the batch, longer)
    stage bench_gpu.log "$limit" "$PY" bench.py "${BENCH[@]}" --deadline $((limit > 80 ? limit - 80 : 0)) \
        --out "$OUT/bench_gpu.md"
}

steps() {   # each eager decode step of five policies timed, in what is left of the call: cut short, it reports the
    # rollouts that finished, so dense first (the baseline), then the widest gaps over it on the H100 (H2O, SnapKV)
    stage step_times.txt 150 "$PY" bench_static.py "${TIMES[@]}" --rounds 1 --policies full,h2o,snapkv,streaming,rkv \
        --step-times
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
            *bench_gpu.md) echo "rows skipped past the deadline: $(grep -c "skipped: past the deadline" "$f")," \
                                "rows failed: $(grep -c "| error: " "$f")"
                           sed -n '/^### Targets/,$p' "$f" ;;
        esac
    done
}

machine
for step in "${STEPS[@]}"; do "$step"; done
digest
echo "$(date +%T) done in $SECONDS s: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$SUMMARY"
[ ${#FAILED[@]} = 0 ] || { echo "failed: ${FAILED[*]} (see each file in $OUT)" | tee -a "$SUMMARY" >&2; exit 1; }
