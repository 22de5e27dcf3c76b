#!/usr/bin/env bash
# The comparison runs behind README "Results" (docs/method.md sections 4-7), then their report.
#
#   bash reproduce.sh                   # every experiment, then report.py
#   bash reproduce.sh corrections       # one experiment (corrections | schedule | pods), or: report
#                                       # (report reads every experiment's runs: run all three first)
#
# Each run is one `python train.py` with the options below, in results/runs/<variant>-s<seed>, its
# output in results/runs/<variant>-s<seed>.log. A run whose eval.jsonl already ends at the last step
# is skipped, so an interrupted reproduce.sh picks up where it stopped (an unfinished run starts over).
# One thread per run makes the numbers repeatable (thread count changes float sums, hence samples)
# and lets two runs share a 2-core machine: `queue` keeps two running at a time.
# Size: 21 runs of 200 steps (PODS samples twice the rollouts), 3 calibrations (8 s each), the report
# (about a second per final model): 38.6 minutes on a 2-core CPU while a third job shared it.
set -euo pipefail
cd "$(dirname "$0")"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT                     # a failed run stops its sibling too
export OMP_NUM_THREADS=1
OUT=results/runs
SEEDS="0 1 2"
STEPS=200
# A 150-step warm-up leaves the toy model room to lose and to gain (greedy dense accuracy 0.53-0.88
# over the seeds); SnapKV at 24 tokens costs it about half of that, so the correction has work to do.
# Every run of a seed starts from the same warm-up and trains on the same prompts.
COMMON="--warmup-steps 150 --lr 5e-5 --steps $STEPS --eval-every 50 --save-every $STEPS"
mkdir -p "$OUT"

finished() {   # finished DIR: its eval.jsonl ends with the evaluation after the last step
    [ -f "$1/eval.jsonl" ] && [[ "$(tail -n 1 "$1/eval.jsonl")" == *"\"step\": $STEPS,"* ]]
}

run() {   # run NAME SEED [train.py options...]: one training run, its warm-up shared within a seed
    local name=$1 seed=$2; shift 2
    local dir="$OUT/$name-s$seed" warm="$OUT/warmup-s$seed"
    if ! finished "$dir"; then
        rm -f "$dir/metrics.jsonl" "$dir/eval.jsonl"                # an unfinished run starts over
        if [ -d "$warm" ] && [ ! -d "$dir/warmup" ]; then         # train.py reuses <out>/warmup
            mkdir -p "$dir" && cp -r "$warm" "$dir/warmup"
        fi
        echo "$(date +%T) $name seed $seed: python train.py $COMMON --seed $seed --out $dir $*"
        python train.py $COMMON --seed "$seed" --out "$dir" "$@" > "$dir.log" 2>&1 ||
            { echo "$name seed $seed failed: see $dir.log" >&2; return 1; }
    fi
    if [ ! -d "$warm" ] && [ -d "$dir/warmup" ]; then              # the seed's first run shares its warm-up
        cp -r "$dir/warmup" "$warm.$BASHPID" && mv -T "$warm.$BASHPID" "$warm" 2>/dev/null || rm -rf "$warm.$BASHPID"
    fi
}

queue() {   # queue "NAME SEED [options]" ...: those runs in order, two at a time; stops at the first failure
    local job
    for job in "$@"; do
        while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
        run $job &
    done
    while [ -n "$(jobs -rp)" ]; do wait -n; done
}

corrections() {   # experiments 1 and 2: dense GRPO, naive sparse, TIS only, Sparse-RL (SnapKV, budget 24)
    local todo=() seed
    for seed in $SEEDS; do todo+=("dense $seed --policy full"); done      # first: they make the warm-ups
    for seed in $SEEDS; do
        todo+=("naive $seed --correction none" "tis $seed --correction tis" "sparse-rl $seed")
    done
    queue "${todo[@]}"
}

schedule() {   # experiment 3: Sparse-RL under Sparrow's schedule, calibrated on the seed's warm-up (toy defaults)
    local todo=() seed
    for seed in $SEEDS; do
        [ -d "$OUT/warmup-s$seed" ] || queue "dense $seed --policy full"  # the seed's warm-up comes with it
        if [ ! -f "$OUT/schedule-s$seed.json" ]; then
            echo "$(date +%T) python schedule.py --calibrate --model $OUT/warmup-s$seed --out $OUT/schedule-s$seed.json"
            python schedule.py --calibrate --model "$OUT/warmup-s$seed" --out "$OUT/schedule-s$seed.json" \
                > "$OUT/calibrate-s$seed.log" 2>&1
        fi
        todo+=("schedule $seed --schedule $OUT/schedule-s$seed.json")
    done
    queue "${todo[@]}"
}

pods() {   # experiment 4: PODS n = 16 -> m = 8 against plain GRPO with 8; 64 trained rollouts per step
    local todo=() seed
    for seed in $SEEDS; do
        todo+=("grpo8 $seed --policy full --eval-every 25"
               "pods16to8 $seed --policy full --eval-every 25 --group-size 16 --keep 8")
    done
    queue "${todo[@]}"
}

report() {   # results/corrections.md and results/pods.md, each with its PNGs (results/<name>_*.png)
    python -c "import matplotlib" 2>/dev/null || echo "no matplotlib, so no PNGs: pip install matplotlib" >&2
    python report.py runs "$OUT"/{dense,naive,tis,sparse-rl,schedule}-s? --robust-budgets 24 20 \
        --out results/corrections
    python report.py runs "$OUT"/{grpo8,pods16to8}-s? --out results/pods
}

for experiment in "${@:-corrections schedule pods report}"; do
    for step in $experiment; do
        case $step in
            corrections|schedule|pods|report) "$step" ;;
            *) echo "unknown step '$step': corrections, schedule, pods or report" >&2; exit 2 ;;
        esac
    done
done
