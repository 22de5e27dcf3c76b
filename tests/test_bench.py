"""bench.py --quick runs end to end and its numbers agree with each other. No timed assertions:
speeds differ between machines and runs; only the relations between reported numbers are checked."""
import json
import math
import statistics

import pytest
import torch

import bench
import bench_gpu
import kvcache
import sampler
from kvcache import SparseConfig
from sampler import generate


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("bench") / "nested" / "bench.json"      # the folder does not exist yet


@pytest.fixture(scope="module")
def quick(out):
    record = bench.main(["--quick", "--out", str(out)])
    return record, json.loads(out.read_text())


def test_the_json_file_holds_the_record_and_the_tables_lie_beside_it(quick, out):
    record, saved = quick
    assert saved["throughput"].keys() == record["throughput"].keys()
    assert saved["table"] == record["table"]
    assert saved["settings"]["batch"] == bench.QUICK["batch"]
    assert out.with_suffix(".md").read_text() == record["table"] + "\n"
    assert record["table"].startswith("Machine: ") and "### Targets" in record["table"]


def test_every_sampler_is_measured(quick):
    record, _ = quick
    assert list(record["throughput"]) == [bench.HF, "full"] + bench.SPARSE
    assert bench.SPARSE[:4] == bench.EVICTION == ["streaming", "h2o", "snapkv", "rkv"]
    assert isinstance(record["disturbed_runs"], list)   # too short to judge in --quick, but always present
    for row in record["throughput"].values():
        assert len(row["seconds"]) == bench.QUICK["repeats"] and row["tokens_per_s"] > 0


def test_ratios_are_quotients_of_the_reported_speeds(quick):
    record, _ = quick
    rows = record["throughput"]
    for name, row in rows.items():
        assert math.isclose(row["vs_hf"], row["tokens_per_s"] / rows[bench.HF]["tokens_per_s"])
        assert math.isclose(row["vs_dense"], row["tokens_per_s"] / rows["full"]["tokens_per_s"])
    long = record["long"]
    assert math.isclose(long[bench.LONG_POLICY]["vs_dense"],
                        long[bench.LONG_POLICY]["tokens_per_s"] / long["full"]["tokens_per_s"])
    # the printed table shows the same ratio the JSON holds
    assert f"| ours full | {rows['full']['tokens_per_s']:.1f} | {rows['full']['vs_hf']:.2f}x | 1.00x |" in record["table"]


def test_our_dense_tokens_equal_hugging_face(quick):
    record, _ = quick
    assert record["throughput"]["full"]["same_tokens_as_hf"] is True
    assert "tokens equal: True" in record["table"]


def test_peak_kv_bytes_match_the_formula_and_the_budget(quick):
    record, _ = quick
    s = bench.QUICK
    head_dim = s["hidden"] // s["heads"]
    for row in record["throughput"].values():
        formula = 2 * s["layers"] * s["kv_heads"] * head_dim * row["peak_kv_tokens"] * 4 * s["batch"]
        assert row["peak_kv_bytes"] == row["kv_formula_bytes"] == formula
    assert record["throughput"]["full"]["peak_kv_tokens"] == s["prompt"] + s["new"] - 1   # the last token is never fed
    assert record["throughput"][bench.HF]["peak_kv_bytes"] == record["throughput"]["full"]["peak_kv_bytes"]
    for name in bench.EVICTION:
        assert record["throughput"][name]["peak_kv_tokens"] == s["budget"] + s["interval"]
    for name in set(bench.SPARSE) - set(bench.EVICTION):                  # block top-k keeps every token
        assert record["throughput"][name]["peak_kv_tokens"] == record["throughput"]["full"]["peak_kv_tokens"]
    assert "| NO |" not in record["table"]


def test_scaling_covers_every_context(quick):
    record, _ = quick
    assert [row["context"] for row in record["scaling"]] == list(bench.QUICK["contexts"])
    for row in record["scaling"]:
        assert row["full"] > 0 and row[bench.LONG_POLICY] > 0
        assert math.isclose(row["ratio"], row["full"] / row[bench.LONG_POLICY])


def test_overheads_are_shares_of_the_right_wholes(quick):
    record, _ = quick
    over = record["overheads"]
    for name in bench.SPARSE:   # every sparse sampler chooses (block top-k: in the third, sparse layer)
        assert 0 < record["throughput"][name]["evict_share"] < 1
    assert record["throughput"]["full"]["evict_share"] == 0          # the full cache never compresses
    assert set(over["interval_1"]) == {"snapkv", "rkv"} and all(0 < v < 1 for v in over["interval_1"].values())
    assert "todo" not in over, "correction.py is in the repo: the correction row must be measured"
    assert 0 < over["correction_seconds"] < over["train_step_seconds"]
    dense_seconds = statistics.median(record["throughput"]["full"]["seconds"])
    assert math.isclose(over["rescore_vs_dense_rollout"], over["rescore_seconds"] / dense_seconds)


def test_the_limit_is_positive_and_the_tables_are_printed(quick):
    record, _ = quick
    lim = record["limit"]
    assert lim["mm_flops"] > 0 and lim["copy_bytes_per_s"] > 0 and 0 < lim["decode_flops"]
    for heading in ("### 1. Throughput", "### 2. Memory", "### 3. Scaling", "### 4. Overheads", "### 5. The limit",
                    "### Targets", "Total wall time"):
        assert heading in record["table"]


def test_an_eviction_wrapper_is_removed_after_use():
    names = ("compress", "page_plan", "top_pages")           # block top-k's choice: its shared plan and each layer's
    before = [getattr(bench.kvcache, name) for name in names]
    with bench.eviction_clock():
        assert all(getattr(bench.kvcache, name) is not fn for name, fn in zip(names, before))
    assert all(getattr(bench.kvcache, name) is fn for name, fn in zip(names, before))


# ----------------------------------------------------------------------------- bench.py --gpu (bench_gpu.py)

@pytest.fixture(scope="module")
def gpu_quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu") / "nested" / "bench_gpu.md"
    record = bench.main(["--gpu", "--quick", "--out", str(out)])
    return record, out.read_text(), json.loads(out.with_suffix(".json").read_text())


def test_gpu_bench_writes_every_row_table_and_target(gpu_quick):
    record, text, saved = gpu_quick
    keys = [f"{bench_gpu.row_label(sampler, extra)} {length}" for sampler, length, extra in bench_gpu.ROWS]
    assert "ours full captured=True new" in keys
    assert list(record["rows"]) == list(saved["rows"]) == keys
    for heading in ("### 1.", "### 2.", "### 3.", "### 4.", "### Targets", "Total wall time"):
        assert heading in text
    assert "skipped" not in text and " - |" not in text.split("### Targets")[1]   # every target has a number
    assert all(row["tokens_per_s"] > 0 and row["peak_bytes"] is None for row in record["rows"].values())  # CPU: n/a


def test_gpu_bench_kv_columns_equal_the_formula_by_hand(gpu_quick):
    record, text, _ = gpu_quick
    rows, s = record["rows"], bench_gpu.TINY            # 2 layers, 2 KV heads of 64 / 4 = 16, batch 4
    per_token = 2 * 2 * 2 * 16 * 2 * 4                  # K and V * layers * KV heads * head_dim * 2 bytes (bf16) * batch
    dense = 32 + 64 - 1                                 # prompt + new, the last token never fed
    assert rows["ours full new"]["rollout_kv_bytes"] == per_token * dense == 97280
    assert f"| {bench_gpu.size(97280)} |" in next(line for line in text.splitlines() if line.startswith("| ours full | 32+64"))
    prompt_len, steps, _ = bench_gpu.plan(s, "full", "new")   # prefill to the mean context, then warm + window
    assert rows["ours full new"]["kv_tokens"] == rows["HF generate new"]["kv_tokens"] == prompt_len + steps - 1
    assert rows["ours full new"]["kv_formula_bytes"] == per_token * (prompt_len + steps - 1)
    for name in bench.EVICTION:                         # budget 32 + interval 8, at any length
        assert rows[f"ours {name} any"]["kv_tokens"] == 40 and rows[f"ours {name} any"]["rollout_kv_bytes"] == per_token * 40


def test_the_timed_window_counts_the_steps_a_graph_replays(monkeypatch):
    # a CUDA graph replays a step without calling the model: a capture that replays the first static step's
    # output stands in for it here. The window's clock must still start before pass 10, not at the model's 10th call
    def replaying(step, cache):
        first = []

        def run(*args):
            first.append(first[0] if first else step(*args))
            cache.end_step()
            return first[0]
        return run
    monkeypatch.setattr(sampler, "capture", replaying)
    model, prompts = bench_gpu.qwen3_model(bench_gpu.TINY, torch.device("cpu")), [[1, 2, 3]] * 2
    model_calls, clocked = [], []
    model.register_forward_pre_hook(lambda *args: model_calls.append(1))
    with bench_gpu.forward_calls(model, "full", 10, lambda: clocked.append(len(model_calls))):
        generate(model, prompts, SparseConfig("full"), max_new_tokens=20, temperature=0, captured=True)
    assert clocked == [2] and len(model_calls) == 2          # the prefill and the first static step; 18 replayed


def test_largest_batch_doubles_then_bisects_to_the_known_answer():
    found, tries = bench_gpu.largest_batch(lambda b: b <= 300, start=64, cap=1024)
    assert 300 - 300 // 16 <= found <= 300 and (found, True) in tries and len(tries) <= 10
    assert bench_gpu.largest_batch(lambda b: b <= 5, 4, 64)[0] == 5
    assert bench_gpu.largest_batch(lambda b: b <= 2, 4, 64)[0] == 2                 # below the first try
    assert bench_gpu.largest_batch(lambda b: True, 4, 16) == (16, [(4, True), (8, True), (16, True)])   # the cap
    assert bench_gpu.largest_batch(lambda b: False, 4, 16)[0] == 0


def test_the_batch_search_allocates_under_a_fake_memory_limit(monkeypatch):
    """One layer's key buffer may hold 41000 bytes: dense (32 + 96 slots of 2 KV heads x 16 x 2 bytes = 8192 bytes a row)
    fits 5 rows, SnapKV at budget 48 (+ interval 8 = 56 slots, 3584 bytes a row) 11: found by running the sampler."""
    real = kvcache.Layer.__init__

    def limited(layer, key, capacity, *args, **kwargs):
        if key.shape[0] * key.shape[1] * capacity * key.shape[3] * key.element_size() > 41000:
            raise torch.OutOfMemoryError("fake limit")
        real(layer, key, capacity, *args, **kwargs)
    monkeypatch.setattr(kvcache.Layer, "__init__", limited)
    s = dict(bench_gpu.TINY)
    model = bench_gpu.qwen3_model(s, torch.device("cpu"))
    for policy, expected in (("full", 5), ("snapkv", 11)):
        sparse, peaks = SparseConfig(policy, budget=s["search_budget"], interval=s["interval"]), {}
        found, tries = bench_gpu.largest_batch(lambda b: bench_gpu.fits(model, s, sparse, b, peaks), 4, 64)
        assert found == expected and (expected + 1, False) in tries


def test_rows_past_the_deadline_are_written_as_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(bench_gpu.TINY, "deadline", 0)
    record = bench.main(["--gpu", "--quick", "--out", str(tmp_path / "late.md")])
    text = (tmp_path / "late.md").read_text()
    skipped = len(bench_gpu.ROWS) + 1 + len(bench_gpu.TINY["rescore_batches"]) + 2   # tables 1, 2, 3, 4
    assert record["rows"] == {} and text.count("skipped: past the deadline") == skipped
    assert "| ... and turns it into more tokens/s | - |" in text


def test_report_lines_reach_the_file_before_the_run_ends(tmp_path):
    report = bench_gpu.Report(tmp_path / "new" / "t.md")
    report.table("### T", ["a", "b"])
    report.row([1, 2])
    assert (tmp_path / "new" / "t.md").read_text().endswith("| a | b |\n|---|---|\n| 1 | 2 |\n")


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--repeats", "0"], "--repeats must be >= 1, got 0"),          # was: the default, silently
    (["--model", "no-such-model"], "model 'no-such-model' is neither an existing folder"),
    (["--quick", "--model", "x"], "cannot be combined with --model"),
])
def test_bad_flags_are_one_error_line_before_any_timing(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(bench, "throughput", lambda *a: pytest.fail("it started timing"))
    with pytest.raises(SystemExit):
        bench.main(argv)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_out_that_cannot_be_written_is_refused_before_the_bench_runs(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    for out, message in ((tmp_path, "is a folder; give a file name"), (f"{tmp_path}/new/", "is a folder"),
                         (tmp_path / "afile" / "b.json", "File exists")):
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--out", str(out)])
        assert message in capsys.readouterr().err
