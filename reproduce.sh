#!/usr/bin/env bash
# The comparison runs behind README "Results" and "DistillSparse" (docs/method.md sections 4-7), then their reports.
#
#   bash reproduce.sh                   # every experiment, then the reports
#   bash reproduce.sh corrections       # one experiment: corrections | policies | schedule | pods | distill | sort,
#                                       # or: report (reads every experiment's runs: run them first)
#
# Each run is one `python train.py` with the options below, in results/runs/<variant>-s<seed>, its output in
# results/runs/<variant>-s<seed>.log. A run whose eval.jsonl already ends at the last step is skipped, so an
# interrupted reproduce.sh picks up where it stopped (an unfinished run starts over). One thread per run makes
# the numbers repeatable (the thread count can change float sums, hence samples) and lets two runs share a
# 2-core machine: `queue` keeps two running at a time. Every run of a task and seed starts from the same
# warm-up and trains on the same prompts.
set -euo pipefail
cd "$(dirname "$0")"
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT                     # a failed run stops its sibling too
export OMP_NUM_THREADS=1
OUT=results/runs
SEEDS="0 1 2"
STEPS=200
COMMON="--steps $STEPS --eval-every 25 --save-every $STEPS"          # pick: train.py's defaults otherwise
# sort, the hard case: a 150-step warm-up (instead of 400) leaves room to lose and to gain; lr 5e-5
SORT="--task sort --warmup-steps 150 --lr 5e-5"
mkdir -p "$OUT"

finished() {   # finished DIR: its eval.jsonl ends with the evaluation after the last step
    [ -f "$1/eval.jsonl" ] && [[ "$(tail -n 1 "$1/eval.jsonl")" == *"\"step\": $STEPS,"* ]]
}

run() {   # run NAME SEED [train.py options...]: one training run, its warm-up shared within a task and seed
    local name=$1 seed=$2; shift 2
    local task=pick; [[ $name == sort-* ]] && task=sort
    local dir="$OUT/$name-s$seed" warm="$OUT/warmup-$task-s$seed"
    if ! finished "$dir"; then
        rm -f "$dir/metrics.jsonl" "$dir/eval.jsonl"                # an unfinished run starts over
        if [ -d "$warm" ] && [ ! -d "$dir/warmup" ]; then         # train.py reuses <out>/warmup (same settings)
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
    local job pid pids=()
    for job in "$@"; do
        while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n; done
        run $job &
        pids+=($!)
    done
    while [ -n "$(jobs -rp)" ]; do wait -n; done
    # a run that ended after the last wait -n returned, but before jobs -rp looked, is no longer running and was
    # never waited for: its failure passed unseen. wait PID still has every run's status
    for pid in "${pids[@]}"; do wait "$pid"; done
}

corrections() {   # dense GRPO, naive sparse, TIS only, Sparse-RL (SnapKV, budget 12); dense makes the warm-ups
    local todo=() seed
    for seed in $SEEDS; do todo+=("dense $seed --policy full"); done
    for seed in $SEEDS; do
        todo+=("naive $seed --correction none" "tis $seed --correction tis" "sparse-rl $seed")
    done
    queue "${todo[@]}"
}

policies() {   # Sparse-RL with each eviction policy at budget 12 (SnapKV is corrections' sparse-rl)
    local todo=() seed policy
    for seed in $SEEDS; do
        for policy in rkv h2o streaming random; do todo+=("policy-$policy $seed --policy $policy"); done
    done
    queue "${todo[@]}"
}

schedule() {   # Sparse-RL under Sparrow's schedule, calibrated on the seed's warm-up
    local todo=() seed
    for seed in $SEEDS; do
        [ -d "$OUT/warmup-pick-s$seed" ] || queue "dense $seed --policy full"   # the seed's warm-up comes with it
        if [ ! -f "$OUT/schedule-s$seed.json" ]; then
            echo "$(date +%T) python schedule.py --calibrate --model $OUT/warmup-pick-s$seed --out $OUT/schedule-s$seed.json"
            python schedule.py --calibrate --model "$OUT/warmup-pick-s$seed" --out "$OUT/schedule-s$seed.json" \
                > "$OUT/calibrate-s$seed.log" 2>&1
        fi
        todo+=("schedule $seed --schedule $OUT/schedule-s$seed.json")
    done
    queue "${todo[@]}"
}

pods() {   # PODS n = 16 -> m = 8 against plain GRPO with 8 (corrections' dense runs): 64 trained rollouts a step
    local todo=() seed
    for seed in $SEEDS; do todo+=("pods16to8 $seed --policy full --group-size 16 --keep 8"); done
    queue "${todo[@]}"
}

distill() {   # DistillSparse on top of Sparse-RL at budget 12, where the tail is far below 0.86: Sparrow's loss
    local todo=() seed run side # (ppo-kl) and the pure KL; then the budgets that hold 0.86 with each final policy,
    for seed in $SEEDS; do      # its adapter off and on
        todo+=("distill $seed --distill ppo-kl" "distill-kl $seed --distill kl")
    done
    queue "${todo[@]}"
    for run in distill distill-kl; do
        for seed in $SEEDS; do
            local ckpt="$OUT/$run-s$seed/step-$(printf %06d $STEPS)"
            for side in off on; do
                [ -f "$OUT/$run-s$seed-$side.json" ] && continue
                echo "$(date +%T) python schedule.py --calibrate --model $ckpt (adapter $side)"
                python schedule.py --calibrate --model "$ckpt" --out "$OUT/$run-s$seed-$side.json" \
                    $([ $side = on ] && echo --adapter "$ckpt/adapter.safetensors") \
                    > "$OUT/calibrate-$run-s$seed-$side.log" 2>&1
            done
        done
    done
}

hard_case() {   # sort, the hard case, every token load-bearing: the corrections on sort (budget 24)
    local todo=() seed
    for seed in $SEEDS; do todo+=("sort-dense $seed $SORT --policy full"); done
    for seed in $SEEDS; do
        todo+=("sort-naive $seed $SORT --correction none" "sort-tis $seed $SORT --correction tis"
               "sort-sparse-rl $seed $SORT")
    done
    queue "${todo[@]}"
}

report() {   # results/<experiment>.md with PNGs (results/<experiment>_*.png), and results/keeps.png
    python -c "import matplotlib" 2>/dev/null || echo "no matplotlib, so no PNGs: pip install matplotlib" >&2
    python report.py runs "$OUT"/{dense,naive,tis,sparse-rl,schedule}-s? --robust-budgets 12 10 \
        --out results/corrections
    python report.py runs "$OUT"/{sparse-rl,distill,distill-kl}-s? --robust-budgets 12 10 --out results/distill
    python report.py runs "$OUT"/{sparse-rl,policy-rkv,policy-h2o,policy-streaming,policy-random}-s? --out results/policies
    python report.py runs "$OUT"/{dense,pods16to8}-s? --out results/pods
    python report.py runs "$OUT"/sort-{dense,naive,tis,sparse-rl}-s? --robust-budgets 24 20 --out results/sort
    python keeps.py --model "$OUT/warmup-pick-s0" --out results/keeps.png > results/keeps.md
    budgets > results/distill_budgets.txt
}

budgets() {   # a line per calibration: the budgets that hold 0.86, and what the cost model predicts for its schedule
    local log json
    for log in "$OUT"/calibrate-s?.log "$OUT"/calibrate-distill{,-kl}-s?-{off,on}.log; do
        json=$( [ -f "$log" ] && sed -n 's/^wrote //p' "$log" || true)
        if [ -z "$json" ] || [ ! -f "$json" ]; then   # a killed calibration: its log, no schedule (or no log at all)
            echo "$log: no schedule written (unfinished or not run): rerun its experiment (schedule or distill)"
            continue
        fi
        echo "$log: $(grep -h "smallest constant budget" "$log"); stretched to 32K tokens:" \
             "$(python schedule.py --speedup "$json" | grep stretched | cut -d'|' -f3-5)"
    done
}

for experiment in "${@:-corrections policies schedule pods distill sort report}"; do
    for step in $experiment; do
        case $step in
            corrections|policies|schedule|pods|distill|report) "$step" ;;
            sort) hard_case ;;
            *) echo "unknown step '$step': corrections, policies, schedule, pods, distill, sort or report" >&2; exit 2 ;;
        esac
    done
done
