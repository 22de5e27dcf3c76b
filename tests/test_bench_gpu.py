"""bench.py --gpu (bench_gpu.py) runs end to end on its tiny shape, on any device: every row, table and target is
written, its cells agree with the formulas by hand, and a run cut short keeps what it measured. No timed
assertions; the GPU itself runs it through gpu_check.sh (tests/test_gpu_check.py)."""
import json
import types

import pytest
import torch

import bench
import bench_gpu
import clocks
import cost
import kvcache
import policies
import sampler
from kvcache import SparseConfig


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
    assert "| our dense >= 1.0x HF generate, tiny shape, bf16 (32+64; 32+128) |" in text   # not "1.7B": a quick run
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


def test_gpu_bench_weights_json_targets_and_cells_by_hand(gpu_quick):
    # Pins bench_gpu's record and cells: weights at bf16's 2 bytes a parameter (4 would be fp32's), no token tensor
    # left in the JSON's rows or batch rows, the 8 targets written as rows of their table, tokens = HF 1.000 for
    # our dense rows (greedy on the same weights), and table 4's bandwidth share as a percentage, not "-"
    record, text, saved = gpu_quick
    model = bench_gpu.qwen3_model(bench_gpu.TINY, torch.device("cpu"))
    assert record["weight_bytes"] == 2 * sum(p.numel() for p in model.parameters())
    assert all("tokens" not in row for group in ("rows", "batch") for row in saved[group].values())
    targets = text.split("### Targets")[1]
    assert len(record["targets"]) == 8 and all(f"| {t} | {m} |" in targets for t, m in record["targets"].items())
    table_1, table_4 = (text.split(a)[1].split(b)[0].splitlines() for a, b in (("### 1.", "### 2."), ("### 4.", "###")))
    dense = [row for row in table_1 if row.startswith("| ours full |")]
    assert len(dense) == 2 and all(row.endswith("| 1.000 |") for row in dense)
    assert [row.endswith(" % |") for row in table_4 if row.startswith("| ours")] == [True, True]


def test_gpu_bench_copies_copy_mib_and_runs_its_captured_rows_captured(tmp_path, monkeypatch):
    # Pins bench_gpu.main's bandwidth buffer (copy_mib MiB of 4-byte values) and window_run / measure_row passing
    # **extra on: the 6 captured rows of table 1 reach generate with captured=True (else they time eager decoding)
    copies, captured = [], []
    monkeypatch.setattr(bench_gpu, "copy_bandwidth", lambda values, device: copies.append(values) or 1e10)
    real = bench.generate
    monkeypatch.setattr(bench, "generate", lambda *a, **k: (captured.append(k.get("captured")), real(*a, **k))[1])
    bench.main(["--gpu", "--quick", "--out", str(tmp_path / "g.md")])
    assert copies == [bench_gpu.TINY["copy_mib"] * 2**20 // 4]
    assert captured.count(True) == sum(extra == bench_gpu.CAPTURED for _, _, extra in bench_gpu.ROWS) == 6


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
    record = bench.main(["--gpu", "--quick", "--deadline", "0", "--out", str(tmp_path / "late.md")])
    text = (tmp_path / "late.md").read_text()
    skipped = len(bench_gpu.ROWS) + 1 + len(bench_gpu.TINY["rescore_batches"]) + 2   # tables 1, 2, 3, 4
    assert record["rows"] == {} and text.count("skipped: past the deadline") == skipped
    assert "| ... and turns it into more tokens/s | - |" in text


def test_a_row_that_fails_costs_only_itself_and_the_run_exits_naming_it(tmp_path, monkeypatch, capsys):
    # one device call a session: a broken row (the h2o rows of table 1, HF in table 2, micro-batch 2 in table 3,
    # table 4's batch search) must not lose what comes after it; its error is its cell, the run still writes its
    # targets, and exits non-zero
    window_run, dense_logprobs = bench_gpu.window_run, bench_gpu.dense_logprobs

    def broken(model, s, sampler, *args, **kwargs):
        if sampler == "h2o" or (sampler == bench.HF and "search_new" not in s):   # table 2's settings lack it
            raise RuntimeError(f"{sampler} is broken\nsecond line")
        return window_run(model, s, sampler, *args, **kwargs)

    def rescoring(model, rollouts, batch_size, topk):
        if batch_size == 2:
            raise ValueError("re-scoring is broken")
        return dense_logprobs(model, rollouts, batch_size=batch_size, topk=topk)
    monkeypatch.setattr(bench_gpu, "window_run", broken)
    monkeypatch.setattr(bench_gpu, "dense_logprobs", rescoring)
    monkeypatch.setattr(bench_gpu, "largest_batch", lambda *a: 1 / 0)
    with pytest.raises(SystemExit, match="^bench.py --gpu: 6 row.s. failed .tracebacks above.: table 1: ours h2o any"):
        bench.main(["--gpu", "--quick", "--out", str(tmp_path / "e.md")])
    text, saved = (tmp_path / "e.md").read_text(), json.loads((tmp_path / "e.json").read_text())
    assert "| ours h2o | any length | error: RuntimeError: h2o is broken |" in text and "second line" not in text
    assert "| HF generate | context 32-48 | error: RuntimeError: HF generate is broken | - |" in text
    assert "| ours full | context 32-48 | " in text and "| 2 | error: ValueError: re-scoring is broken | " in text
    assert "| ours full | error: ZeroDivisionError: division by zero |" in text
    assert len(saved["rows"]) == len(bench_gpu.ROWS) - 2 and list(saved["shape"]) == ["full"]   # the rest measured
    assert list(saved["rescore"]) == ["4"] and saved["rescore"]["4"]["seconds"] > 0
    assert set(saved["errors"]) == {"table 1: ours h2o any", "table 1: ours h2o captured=True any",
                                    "table 2: HF generate", "table 3: micro-batch 2",
                                    "table 4: ours full", f"table 4: ours {bench.LONG_POLICY}, budget 48"}
    assert "### Targets" in text and "Traceback" in capsys.readouterr().err


def test_a_ctrl_c_inside_a_row_still_ends_the_run_and_writes_its_json(tmp_path, monkeypatch):
    # `attempt` keeps an error to its row, never a KeyboardInterrupt: gpu_check.sh's SIGINT at the stage's limit
    window_run = bench_gpu.window_run

    def interrupted(model, s, sampler, *args, **kwargs):
        if sampler == "h2o":
            raise KeyboardInterrupt
        return window_run(model, s, sampler, *args, **kwargs)
    monkeypatch.setattr(bench_gpu, "window_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--gpu", "--quick", "--out", str(tmp_path / "c.md")])
    saved = json.loads((tmp_path / "c.json").read_text())
    assert list(saved["rows"]) == ["HF generate new", "ours full new", "HF generate long_new", "ours full long_new",
                                   "ours streaming any"] and saved["errors"] == {}


@pytest.mark.parametrize("argv, message", [(["--deadline", "5"], "without --gpu"),
                                           (["--gpu", "--deadline", "-1"], "must be >= 0, got -1.0")])
def test_deadline_goes_with_gpu_and_is_not_negative(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_an_infinite_deadline_is_no_deadline_and_nan_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_gpu, "main", lambda args: args.deadline)    # past the checks: the bench itself
    assert bench.main(["--gpu", "--deadline", "inf", "--out", str(tmp_path / "g.md")]) == float("inf")
    with pytest.raises(SystemExit):
        bench.main(["--gpu", "--deadline", "nan", "--out", str(tmp_path / "g.md")])
    assert "--deadline goes with --gpu and must be >= 0, got nan" in capsys.readouterr().err


def test_a_run_cut_short_still_writes_its_targets_and_json(tmp_path, monkeypatch):
    # gpu_check.sh stops a stage past its limit with SIGINT: what tables 1 and 2 measured must come back
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_gpu, "table_3", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--gpu", "--quick", "--out", str(tmp_path / "cut.md")])
    saved = json.loads((tmp_path / "cut.json").read_text())
    assert len(saved["rows"]) == len(bench_gpu.ROWS) and saved["shape"] and not saved["batch"]
    assert all("tokens" not in row for row in saved["rows"].values())
    text = (tmp_path / "cut.md").read_text()
    assert "### 3." not in text and "### Targets" in text and "Total wall time" in text
    assert "| ... and turns it into more tokens/s | - |" in text      # table 4 never ran


def test_report_lines_reach_the_file_before_the_run_ends(tmp_path):
    report = bench_gpu.Report(tmp_path / "new" / "t.md")
    report.table("### T", ["a", "b"])
    report.row([1, 2])
    assert (tmp_path / "new" / "t.md").read_text().endswith("| a | b |\n|---|---|\n| 1 | 2 |\n")


def test_kv_read_bytes_of_the_1_7b_shape_by_hand():
    # Pins kv_read_bytes, the bytes behind table 1's and table 4's "of the bandwidth bound" (the README's GPU table):
    # 28 layers, 8 KV heads of 2048 / 16 = 128, batch 64, bf16: one layer's K and V of one token, every row, is
    # 2 x 8 x 128 x 2 bytes x 64 = 262144 bytes (256 KiB)
    s = dict(layers=28, hidden=2048, heads=16, kv_heads=8, ffn=6144, vocab=151936, batch=64, budget=512, interval=128)
    assert (SparseConfig.page_size, SparseConfig.dense_layers, policies.RESERVED_PAGES) == (16, 2, 3)
    # dense at context 1024: 28 x 256 KiB x 1024 = 7 GiB
    assert bench_gpu.kv_read_bytes(s, "full", 1024, 64) == 7 * 2**30
    # eviction holds 512 .. 512 + 128 tokens: 576 on average, at any context: 28 x 256 KiB x 576
    for name in bench.EVICTION:
        assert bench_gpu.kv_read_bytes(s, name, 1024, 64) == 28 * 262144 * 576 == 4227858432
    # block top-k at 1024: 2 dense layers read 1024 tokens, 26 read 512 // 16 + 3 = 35 pages = 560 tokens, and
    # 1024 / 16 = 64 fp32 page key sums of 8 x 128 x 4 bytes x 64 rows = 262144 bytes a page:
    # 262144 x (2 x 1024 + 26 x 560 + 26 x 64) = 262144 x 18272
    assert bench_gpu.kv_read_bytes(s, "blocktopk", 1024, 64) == 262144 * 18272 == 4789895168
    # at context 300 (under 560) the sparse layers read what there is: 262144 x (28 x 300 + 26 x 300 / 16)
    assert bench_gpu.kv_read_bytes(s, "blocktopk", 300, 64) == 262144 * (28 * 300 + 26 * 18.75) == 2329804800
    # batch and budget are the arguments', not the settings' (table 4 times another batch at its search budget)
    assert bench_gpu.kv_read_bytes(s, "snapkv", 1024, 1, budget=1024) == 28 * 4096 * (1024 + 64)


def test_a_shapes_own_head_dim_sizes_the_model_and_its_read_bytes_as_the_kv_formula():
    # Qwen3 sets head_dim apart from hidden / heads (0.6B: 128, not 1024 / 16 = 64); here 32, not 64 / 4 = 16. The
    # model, the bytes a dense step reads and the KV formula column must all use the shape's one head width.
    s = dict(bench_gpu.TINY, head_dim=32)
    assert bench_gpu.qwen3_model(s, torch.device("cpu")).config.head_dim == 32
    dense = bench_gpu.kv_read_bytes(s, "full", 100, 3)        # K and V * layers * KV heads * 32 * tokens * bf16 * batch
    assert dense == cost.kv_bytes(bench.hf_config(s), 100, 3, 2) == 2 * 2 * 2 * 32 * 100 * 2 * 3


def test_measure_row_shares_weights_and_kv_at_the_windows_middle_over_the_step_time(monkeypatch):
    # Pins measure_row's "of the bandwidth bound": (weights + the KV read at the timed window's middle context)
    # / step seconds / bandwidth, on a fake window_run of 0.25 s a step. TINY, batch 4: one layer's K and V of a
    # token is 2 x 2 KV heads x 16 x 2 bytes x 4 rows = 512 bytes, 2 layers. Dense 32+64: prompt 32 + 32 - 8 - 4
    # = 52, 4 warm steps, the window's contexts 56-72: middle 64 -> 2 x 512 x 64 = 65536 bytes; eviction holds
    # 32 .. 32 + 8: 2 x 512 x 36 = 36864
    monkeypatch.setattr(bench_gpu, "window_run", lambda *a, **k: dict(step_s=0.25, kv_tokens=40, tokens=None))
    s = bench_gpu.TINY
    full = bench_gpu.measure_row(None, s, "full", "new", {}, 1e9, 10_000)
    assert (full["first"], full["steps"]) == (56, 20)
    assert full["bandwidth_share"] == pytest.approx((10_000 + 65536) / 0.25 / 1e9)
    evicting = bench_gpu.measure_row(None, s, "snapkv", "any", {}, 1e9, 10_000)
    assert evicting["bandwidth_share"] == pytest.approx((10_000 + 36864) / 0.25 / 1e9)


def test_window_run_times_the_last_window_passes_on_a_pass_counting_clock(monkeypatch):
    # Pins window_run's timing on a clock that reads the model's forward passes so far: 20 decode passes (the
    # prefill and 19 steps), the clock started before pass 20 - 16 = 4, read again at the end: 16 passes = 16 "s";
    # tokens/s = batch 2 x window 16 / 16 = 2.0 and a step 16 / 16 = 1.0 (not / 20 steps, nor one pass more)
    model, passes = bench_gpu.qwen3_model(bench_gpu.TINY, torch.device("cpu")), []
    model.register_forward_pre_hook(lambda *args: passes.append(1))
    monkeypatch.setattr(bench_gpu, "clock", lambda device: float(len(passes)))
    r = bench_gpu.window_run(model, bench_gpu.TINY, "full", 8, 20, batch=2)
    assert len(passes) == 20 and (r["tokens_per_s"], r["step_s"]) == (2.0, 1.0)
    assert r["tokens"].shape == (2, 20) and r["kv_tokens"] == 8 + 20 - 1


@pytest.mark.parametrize("prompt", [23, 24, 50])
def test_rollout_kv_tokens_is_the_peak_the_sampler_holds(prompt):
    # Pins rollout_kv_tokens ("KV of the whole rollout") against the sampler's own peak, at budget 16 + interval 8:
    # a prompt of 23 peaks at 24 (budget + interval); one of 24 or 50 is kept whole and one fed token joins it
    # before the first compression: 25, 51 (not 24, 50); dense: prompt + 30 new - 1 (the last is never fed)
    s = dict(bench_gpu.TINY, prompt=prompt, interval=8)
    model, ids = bench_gpu.qwen3_model(s, torch.device("cpu")), bench.random_ids(s, 2, prompt)
    for name, expected in (("snapkv", max(prompt + 1, 24)), ("streaming", max(prompt + 1, 24)), ("full", prompt + 29)):
        peak = bench.greedy(model, ids, name, 30, 16, 8)[1]
        assert bench_gpu.rollout_kv_tokens(s, name, 30, budget=16) == peak == expected


def test_rollout_kv_tokens_of_a_rollout_too_short_to_compress_is_the_dense_count():
    # prompt 10 + 5 new holds 14 tokens at its last decode step, short of budget 16 + interval 8: an evicting cache
    # never reaches budget + interval (the formula said 24)
    s = dict(bench_gpu.TINY, prompt=10, interval=8)
    model, ids = bench_gpu.qwen3_model(s, torch.device("cpu")), bench.random_ids(s, 2, 10)
    for name in ("snapkv", "full"):
        assert bench_gpu.rollout_kv_tokens(s, name, 5, budget=16) == bench.greedy(model, ids, name, 5, 16, 8)[1] == 14


@pytest.mark.parametrize("policy", ["full", "snapkv"])
def test_a_fit_test_runs_the_prefill_and_fit_steps_decode_passes(policy):
    # Pins fits' stop: the prefill and fit_steps (2) decode steps allocate, then Enough ends the rollout before
    # pass 3: 3 forward passes (2 would leave the decode step that grows the cache past the prefill untested)
    s = dict(bench_gpu.TINY)
    model, passes, peaks = bench_gpu.qwen3_model(s, torch.device("cpu")), [], {}
    model.register_forward_pre_hook(lambda *args: passes.append(1))
    sparse = SparseConfig(policy, budget=s["search_budget"], interval=s["interval"])
    assert bench_gpu.fits(model, s, sparse, 2, peaks) and peaks == {2: None}     # fitted; a CPU keeps no peak
    assert len(passes) == 1 + s["fit_steps"] == 3


def test_largest_batch_leaves_a_gap_of_at_most_a_sixteenth_of_what_fits():
    # Pins largest_batch's stopping rule by brute force over every limit up to 400: the batch found fits, and the
    # smallest batch tried that did not fit is at most max(1, found // 16) above it (or found is the cap). E.g. a
    # limit of 100 from 64: 64 yes, 128 no, 96 yes, 112 no, 104 no, 100 yes: the gap 4 <= 6 (96 with 104 failing,
    # a gap of 8, would be a 1/12 gap)
    assert bench_gpu.largest_batch(lambda b: b <= 100, 64, 1024)[0] == 100
    for limit in range(0, 401):
        found, tries = bench_gpu.largest_batch(lambda b: b <= limit, 64, 1024)
        failed = min((b for b, ok in tries if not ok), default=None)
        assert found <= limit and (found == 0 or (found, True) in tries)
        assert failed is not None and failed - found <= max(1, found // 16)


def test_table_4_times_each_found_batch_and_shares_its_bandwidth_by_hand(tmp_path, monkeypatch):
    # Pins table_4 / measure_batch on a fake search (dense finds 63, SnapKV the cap 64) and a fake timed run of
    # 0.5 s a step that runs out of memory above batch 50 for SnapKV: 1/16 less each time, 64 -> 60 -> 57 -> 54 ->
    # 51 -> 48. Decode steps 28 + 16 = 44 from the 32-token prompt at budget 48 (plan), the window's contexts 60-76.
    # Bandwidth share = (weights 10000 + KV read) / 0.5 s / 1e9: dense at batch 63 and the middle context 68 reads
    # 2 layers x 2 x 2 KV heads x 16 x 2 bytes x 63 x 68 = 1096704; SnapKV at batch 48 and budget 48 (not the
    # settings' 4 rows, budget 32) holds 48 .. 56 slots: 2 x 2 x 2 x 16 x 2 x 48 x 52 = 638976. KV per row (formula):
    # dense 32 + 96 - 1 = 127 tokens x 2 x 2 x 2 x 16 x 2 bytes = 32512 bytes = 0.03 MiB at batch 1
    found, calls = iter([(63, [(64, False), (63, True)]), (64, [(64, True)])]), []
    monkeypatch.setattr(bench_gpu, "largest_batch", lambda fits, start, cap: next(found))

    def window_run(model, s, sampler, prompt_len, steps, budget=None, batch=None):
        calls.append((sampler, prompt_len, steps, budget, batch))
        if sampler == "snapkv" and batch > 50:
            raise torch.OutOfMemoryError("fake limit")
        return dict(tokens_per_s={"full": 100.0, "snapkv": 300.0}[sampler], step_s=0.5, peak_bytes=None, tokens=None)
    monkeypatch.setattr(bench_gpu, "window_run", window_run)
    s = dict(bench_gpu.TINY, search_cap=64, stop_at=float("inf"))
    report = bench_gpu.Report(tmp_path / "t4.md")
    record = dict(batch={}, errors={}, device=torch.device("cpu"))
    bench_gpu.table_4(type("M", (), dict(device=torch.device("cpu")))(), s, report, record, 1e9, 10_000)
    assert calls == [("full", 32, 44, 48, 63)] + [("snapkv", 32, 44, 48, b) for b in (64, 60, 57, 54, 51, 48)]
    full, snapkv = record["batch"]["full"], record["batch"]["snapkv"]
    assert full["bandwidth_share"] == pytest.approx((10_000 + 1096704) / 0.5 / 1e9)
    assert snapkv["bandwidth_share"] == pytest.approx((10_000 + 638976) / 0.5 / 1e9)
    assert (snapkv["found"], snapkv["batch"]) == (64, 48)
    text = (tmp_path / "t4.md").read_text()
    assert "| ours full | 63 | 64: no, 63: yes | n/a | 0.03 MiB | 100 | 1.00x | 0.2 % |" in text
    assert "| ours snapkv, budget 48 | 64 (the cap), timed at 48 | 64: yes | n/a | 0.01 MiB | 300 | 3.00x | 0.1 % |" in text


def test_size_and_an_unmeasured_row_by_hand(tmp_path):
    # Pins size's binary units (3 x 2^30 bytes are 3.00 GiB, not 3.22 as 1e9 would print) and unmeasured's
    # width: a 4-column table, one cell and the reason leave exactly 2 "-" cells, not 3
    assert [bench_gpu.size(3 * 2**30), bench_gpu.size(1.5 * 2**20), bench_gpu.size(2**30 - 2**20), bench_gpu.size(None)] \
        == ["3.00 GiB", "1.50 MiB", "1023.00 MiB", "n/a"]
    report = bench_gpu.Report(tmp_path / "u.md")
    report.table("### U", ["a", "b", "c", "d"])
    report.unmeasured(["x"], "skipped")
    assert (tmp_path / "u.md").read_text().endswith("|---|---|---|---|\n| x | skipped | - | - |\n")


def test_the_targets_are_ratios_of_the_right_rows_by_hand(tmp_path):
    # Pins targets on a hand-made record: every target's numerator and denominator. Table 1's tokens/s: HF 100
    # (32+64) and 50 (32+128), dense 120 and 70, the four evicting caches 240, 180, 300, 200 (slowest: h2o's 180),
    # dense captured 500 and 250, SnapKV captured 900; table 2: HF 10, dense 15; table 4: dense 8 rows at 100/s,
    # SnapKV 20 rows at 250/s
    rows = {"HF generate new": 100, "HF generate long_new": 50, "ours full new": 120, "ours full long_new": 70,
            "ours streaming any": 240, "ours h2o any": 180, "ours snapkv any": 300, "ours rkv any": 200,
            "ours full captured=True new": 500, "ours full captured=True long_new": 250,
            "ours snapkv captured=True any": 900}
    record = dict(rows={k: dict(tokens_per_s=v) for k, v in rows.items()}, shape={bench.HF: 10, "full": 15},
                  batch={"full": dict(batch=8, tokens_per_s=100), "snapkv": dict(batch=20, tokens_per_s=250)})
    bench_gpu.targets(bench_gpu.TINY, bench_gpu.Report(tmp_path / "t.md"), record)
    assert list(record["targets"].values()) == [
        "1.20x; 1.40x", "1.50x",                    # 120 / 100, 70 / 50; 15 / 10
        "1.50x", "2.57x",                           # slowest eviction 180 / dense 120, 180 / 70
        "20 / 8 = 2.50x", "2.50x",                  # batches; 250 / 100 tokens/s
        "5.00x", "1.80x; 3.60x"]                    # 500 / HF 100 (32+64); 900 / 500, 900 / 250
    del record["rows"]["ours rkv any"]              # one evicting row skipped: no slowest
    bench_gpu.targets(bench_gpu.TINY, bench_gpu.Report(tmp_path / "t.md"), record)
    assert list(record["targets"].values())[2:4] == ["-", "-"]


def test_table_1_ratio_columns_and_table_3_logits_formula(gpu_quick):
    # Pins table 1's "vs HF" and "vs dense" cells against the record's own tokens/s: an evicting row against dense
    # at both lengths, a captured row against dense captured (not HF, not eager dense); and table 3's formula
    # column: micro-batch 4 x 32 response tokens x vocabulary 512 x 4 bytes (fp32) = 262144 bytes = 0.25 MiB
    record, text, _ = gpu_quick
    speed = {key: row["tokens_per_s"] for key, row in record["rows"].items()}
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): [c.strip() for c in line.strip("|").split("|")]
             for line in text.split("### 1.")[1].split("### 2.")[0].splitlines() if line.startswith("| ours")}
    for label, dense in (("ours snapkv", "ours full"), ("ours snapkv captured=True", "ours full captured=True")):
        row = cells[(label, "any length")]
        assert row[4:7] == ["-", bench.ratio(speed[f"{label} any"], speed[f"{dense} new"]),
                            bench.ratio(speed[f"{label} any"], speed[f"{dense} long_new"])]
    row = cells[("ours full", "32+128")]
    assert row[4:7] == [bench.ratio(speed["ours full long_new"], speed["HF generate long_new"]), "-", "1.00x"]
    assert "\n| 4 | n/a | 0.25 MiB | " in text.split("### 3.")[1]


def test_table_3_times_a_warm_rescoring(monkeypatch, tmp_path):
    # Pins table 3's untimed first run: a micro-batch's first re-scoring pays first use (kernels chosen, the
    # allocator's pool grown), which every training step after the first does not. A fake clock: a micro-batch's
    # first call takes 100 s, each later one 1 s; the table must say 1.00
    now, calls = [0.0], []

    def rescoring(model, rollouts, batch_size, topk):
        calls.append(batch_size)
        now[0] += 100.0 if calls.count(batch_size) == 1 else 1.0
    monkeypatch.setattr(bench_gpu, "dense_logprobs", rescoring)
    monkeypatch.setattr(clocks, "clock", lambda device: now[0])   # table_3 times with clocks.timed
    s, record = dict(bench_gpu.TINY, stop_at=float("inf")), dict(rescore={}, errors={}, device=torch.device("cpu"))
    model = types.SimpleNamespace(device=torch.device("cpu"))
    bench_gpu.table_3(model, s, bench_gpu.Report(tmp_path / "t.md"), record)
    assert calls == [4, 4, 2, 2] and {b: r["seconds"] for b, r in record["rescore"].items()} == {4: 1.0, 2: 1.0}
    assert "\n| 4 | n/a | 0.25 MiB | 1.00 |" in (tmp_path / "t.md").read_text()


def test_plan_of_an_evicting_row_whose_prompt_is_already_past_budget_plus_interval():
    # Pins plan's max(1, ...): a prompt of 50 over budget 16 + interval 8 is kept whole until the first decode step
    # compresses it (test_rollout_kv_tokens_is_the_peak_the_sampler_holds: 51 tokens, then budget), so the steady state
    # begins after 1 feed call, not 0: skip = 1 + warm 4; steps = 5 + window 16, the window's first context 50 + 5.
    # Table 4's budget argument, not the settings': budget 40 + 8 - 32 = 16 feed calls + 4 warm
    s = dict(bench_gpu.TINY, prompt=50, budget=16, interval=8)
    assert bench_gpu.plan(s, "snapkv", "any") == (50, 21, 55)
    assert bench_gpu.plan(bench_gpu.TINY, "snapkv", "any", budget=40) == (32, 36, 52)


def test_kv_read_bytes_of_block_top_k_reads_the_pages_of_the_budget_it_is_given():
    # Pins kv_read_bytes's budget argument on the block top-k branch (the eviction branch is pinned above): the
    # 1.7B shape at context 4096 and budget 1024: 26 sparse layers read 1024 // 16 + 3 = 67 pages = 1072 tokens (the
    # settings' budget 512 would be 560), 2 dense layers 4096, and 4096 / 16 = 256 page key sums of 262144 bytes
    s = dict(layers=28, hidden=2048, heads=16, kv_heads=8, ffn=6144, vocab=151936, batch=64, budget=512, interval=128)
    assert bench_gpu.kv_read_bytes(s, "blocktopk", 4096, 64, budget=1024) == 262144 * (2 * 4096 + 26 * 1072 + 26 * 256)


def test_size_at_exactly_1_gib_and_at_0_bytes():
    # Pins size's edges: 2^30 bytes are "1.00 GiB" (not "1024.00 MiB", a strict >), and 0 bytes are "0.00 MiB", a
    # measurement, not "n/a" (that is None's: a CPU's peak), as `not n` would print
    assert [bench_gpu.size(2**30), bench_gpu.size(0)] == ["1.00 GiB", "0.00 MiB"]


def test_largest_batch_never_tries_past_the_cap():
    # Pins largest_batch's two caps: a start above the cap begins at the cap (64 > 16: one try, at 16), and doubling
    # stops at the cap, not at the next power of two times start (4, 8, 16, then 20, not 32)
    assert bench_gpu.largest_batch(lambda b: True, 64, 16) == (16, [(16, True)])
    assert bench_gpu.largest_batch(lambda b: True, 4, 20) == (20, [(4, True), (8, True), (16, True), (20, True)])
    assert bench_gpu.largest_batch(lambda b: b <= 20, 64, 16) == (16, [(16, True)])


def test_a_fit_test_lets_an_error_that_is_not_out_of_memory_through(monkeypatch):
    # Pins fits' except clause: only running out of memory means "does not fit"; any other error (a bug in the
    # sampler) must reach attempt() as the row's error, not shrink the batch search to 0 silently
    s = dict(bench_gpu.TINY)
    model = bench_gpu.qwen3_model(s, torch.device("cpu"))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not memory")
    monkeypatch.setattr(bench_gpu, "generate", broken)
    sparse = SparseConfig("full", budget=s["search_budget"], interval=s["interval"])
    with pytest.raises(RuntimeError, match="a bug, not memory"):
        bench_gpu.fits(model, s, sparse, 2, {})


def test_the_targets_name_their_rows_by_hand(tmp_path):
    # Pins the targets' names (their numbers are pinned above) on TINY: each names the lengths its ratio compares
    # and the README's threshold, so a swapped length or threshold in a label misreports what was measured
    record = dict(rows={}, shape={}, batch={})
    bench_gpu.targets(bench_gpu.TINY, bench_gpu.Report(tmp_path / "t.md"), record)
    assert list(record["targets"]) == [
        "our dense >= 1.0x HF generate, tiny shape, bf16 (32+64; 32+128)",
        "our dense >= 1.0x HF generate, bench.py's FULL shape, bf16",
        "eviction (slowest of 4) >= dense at 32+64",
        "eviction (slowest) > dense at 32+128",
        "snapkv at budget 48 fits >= 2x dense's batch at 32+96",
        "... and turns it into more tokens/s",
        "dense captured >= 4x HF generate at 32+64",
        "snapkv captured >= 1.4x dense captured at 32+64; >= 2x at 32+128"]
    # nothing measured (a run cut short before table 1): every target reads "-", the batch one too, not "None / None = -"
    assert list(record["targets"].values()) == ["-; -", "-", "-", "-", "-", "-", "-", "-; -"]


def test_a_failed_row_frees_what_it_held(tmp_path, monkeypatch):
    # Pins attempt's reset_peak after an error: on a GPU it empties the allocator's cache and its peak, so the rows
    # after a failed one (often out of memory) start clean; a CPU run never shows the difference, a recording fake does
    freed = []
    monkeypatch.setattr(bench_gpu, "reset_peak", freed.append)
    report, record = bench_gpu.Report(tmp_path / "a.md"), dict(errors={}, device="the device")
    report.table("### A", ["row", "value"])
    assert bench_gpu.attempt(record, report, "a row", ["x"], lambda: 1 / 0) is None
    assert freed == ["the device"] and record["errors"] == {"a row": "ZeroDivisionError: division by zero"}
    assert bench_gpu.attempt(record, report, "b row", ["y"], lambda: 7) == 7 and freed == ["the device"]


@pytest.mark.parametrize("policy, slots", [("full", 32 + 96), ("snapkv", 48 + 8)])
def test_a_fit_test_sizes_the_cache_for_the_whole_search_rollout(policy, slots, monkeypatch):
    # Pins fits' rollout: the real prompt (32) + search_new (96) tokens, so a dense cache asks for 128 slots a layer at
    # the prefill (a prompt one token short, or `new` for `search_new`, would fit a batch the whole rollout cannot);
    # an evicting one budget 48 + interval 8, whatever the length
    real, capacities = kvcache.Layer.__init__, []

    def recording(layer, key, capacity, *args, **kwargs):
        capacities.append(capacity)
        real(layer, key, capacity, *args, **kwargs)
    monkeypatch.setattr(kvcache.Layer, "__init__", recording)
    s = dict(bench_gpu.TINY)
    model = bench_gpu.qwen3_model(s, torch.device("cpu"))
    sparse = SparseConfig(policy, budget=s["search_budget"], interval=s["interval"])
    assert bench_gpu.fits(model, s, sparse, 2, {})
    assert capacities and set(capacities) == {slots}
