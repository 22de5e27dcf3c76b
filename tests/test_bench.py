"""bench.py --quick runs end to end and its numbers agree with each other. No timed assertions:
speeds differ between machines and runs; only the relations between reported numbers are checked."""
import json
import math
import os
import statistics
from pathlib import Path

import pytest
import torch

import bench
import clocks
import cost
import kvcache


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
    rollout_seconds = statistics.median(record["throughput"][bench.LONG_POLICY]["seconds"])   # the rollout re-scored
    assert math.isclose(over["rescore_vs_rollout"], over["rescore_seconds"] / rollout_seconds)


def test_the_limit_is_positive_and_the_tables_are_printed(quick):
    record, _ = quick
    lim = record["limit"]
    assert lim["mm_flops"] > 0 and lim["copy_bytes_per_s"] > 0 and 0 < lim["decode_flops"]
    for heading in ("### 1. Throughput", "### 2. Memory", "### 3. Scaling", "### 4. Overheads", "### 5. The limit",
                    "### Targets", "Total wall time"):
        assert heading in record["table"]


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--repeats", "0"], "--repeats must be >= 1, got 0"),          # was: the default, silently
    (["--model", "no-such-model"], "model 'no-such-model' is neither an existing folder"),
    (["--quick", "--model", "x"], "cannot be combined with --model"),
    (["--model", ""], "--model is empty: give a value, or leave the flag out"),          # was: the random model's bench, minutes
    (["--quick", "--out", ""], "--out is empty: give a value, or leave the flag out"),          # was: the default file, silently
    (["--quick", "--repeats", str(2 ** 31)], "--repeats must be < 2**31"),             # was: a wait of years
    (["--gpu", "--repeats", "3"], "error: --gpu takes --quick, --out and --deadline only, not --repeats"),
    (["--gpu", "--model", ""], "--gpu takes --quick, --out and --deadline only, not --model"),   # '' is no model either
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
    with pytest.raises(SystemExit):                                    # --gpu's too: it was a traceback
        bench.main(["--gpu", "--quick", "--out", str(tmp_path / "afile" / "b.md")])
    err = capsys.readouterr().err
    assert "--out '" in err and "File exists" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, folder, bad", [
    (["--quick", "--out", "b.json"], "b.md", "b.md"),                            # the tables beside the JSON
    (["--quick", "--out", "b.json"], "b_scaling.png", "b_scaling.png"),          # the scaling plot
    (["--quick", "--out", "/proc/b.json"], None, "/proc/b.json"),                # the JSON: a folder it cannot write in
    (["--gpu", "--quick", "--out", "g.md"], "g.json", "g.json"),                 # bench_gpu's JSON beside its markdown
    (["--gpu", "--quick"], "results/bench_gpu_quick.json", "results/bench_gpu_quick.json")],   # beside its default
    ids=["md", "png", "json", "gpu-json", "gpu-default"])
def test_every_file_bench_writes_is_checked_before_the_bench_runs(tmp_path, monkeypatch, capsys, argv, folder, bad):
    # check_out_file checked --out alone: a folder where the .md, the _scaling.png or --gpu's .json goes, or a
    # place no file can be written, failed only when the results were written (IsADirectoryError, minutes later)
    import bench_gpu
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "build_model", lambda s: pytest.fail("it built the model"))
    monkeypatch.setattr(bench_gpu, "main", lambda args: pytest.fail("it started the GPU bench"))
    if folder:
        (tmp_path / folder).mkdir(parents=True)
    with pytest.raises(SystemExit):
        bench.main(argv)
    err = capsys.readouterr().err
    assert f"cannot write {bad!r}" in err and "Traceback" not in err
    assert all(p.is_dir() for p in tmp_path.rglob("*"))                       # no file left by the check


def test_the_check_of_the_files_keeps_a_file_that_is_there(tmp_path, monkeypatch):
    # the writability check must neither empty an earlier run's JSON nor leave files of its own (a failed run)
    class Built(Exception):
        pass

    def build_model(s):
        raise Built
    (tmp_path / "b.json").write_text("earlier")
    monkeypatch.setattr(bench, "build_model", build_model)
    with pytest.raises(Built):
        bench.main(["--quick", "--out", str(tmp_path / "b.json")])
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"] and (tmp_path / "b.json").read_text() == "earlier"


def test_the_default_out_folder_is_made_before_any_model_is_built(tmp_path, monkeypatch):
    # Pins main's check_out_file on the default: with no --out, results/ (where every default lies) is made before
    # the work, else a run elsewhere would end in a traceback after minutes of timing
    class Built(Exception):
        pass

    def build_model(s):
        assert (tmp_path / "results").is_dir()
        raise Built
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "build_model", build_model)
    with pytest.raises(Built):
        bench.main(["--quick"])


@pytest.mark.parametrize("model, name", [("Qwen/Qwen3-0.6B", "Qwen3-0.6B"), ("Qwen/Qwen3-0.6B-Base", "Qwen3-0.6B-Base"),
                                         ("smollm2-135m", "smollm2-135m"), ("models/SmolLM2.Q8_0.gguf", "SmolLM2.Q8_0")])
def test_a_models_default_out_keeps_its_whole_name(monkeypatch, model, name):
    # Pins main's default out for --model, checked before the model loads: Path.stem cut both Qwen3-0.6B and
    # Qwen3-0.6B-Base to results/bench_Qwen3-0.json, so the second model's run overwrote the first's
    class Built(Exception):
        pass

    def build_model(s):
        raise Built
    checked = []
    monkeypatch.setattr(bench, "check_out_file", checked.append)
    monkeypatch.setattr(bench, "build_model", build_model)
    with pytest.raises(Built):
        bench.main(["--model", model])
    assert checked == [f"results/bench_{name}.json"]


def test_a_model_of_another_family_is_refused_by_name_before_any_timing(monkeypatch, capsys, tmp_path):
    # A GPT-2 config names its shape n_layer / n_head / n_embd and has no num_key_value_heads: build_model read
    # 'GPT2Config' object has no attribute 'num_key_value_heads', a traceback; the sampler runs Llama, Mistral,
    # Qwen2 and Qwen3 only (hook.SUPPORTED_MODELS)
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=64)).eval()
    monkeypatch.setattr(bench, "load_pretrained", lambda name: (gpt2, None))
    monkeypatch.setattr(bench, "throughput", lambda *a: pytest.fail("it started timing"))
    with pytest.raises(SystemExit):
        bench.main(["--model", "gpt2-like", "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert "error: model 'gpt2-like' is a 'gpt2' model; supported: llama, mistral, qwen2, qwen3" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- the arithmetic, on fake timings

def fake_run(seconds, prefill=0.0, evict=None, kv_tokens=10, tokens=None):
    """One run's dict as bench.run returns it, with known seconds (no model, no clock)."""
    return dict(tokens=torch.zeros(2, 4, dtype=torch.long) if tokens is None else tokens, seconds=seconds,
                prefill=prefill, peak_kv_tokens=kv_tokens, peak_kv_bytes=kv_tokens * 8, evict_seconds=evict,
                stamps=None, others=None)


def fake_report(**changes):
    """bench.report on fake runs through median_run: batch 2, 4 new, 8 long new; every number chosen by hand."""
    s = dict(bench.QUICK, batch=2, new=4, long_new=8, **changes)
    hf = torch.zeros(2, 4, dtype=torch.long)
    full = hf.clone()
    full[0, 3] = 1                                                   # 7 of HF's 8 tokens
    sparse = hf.clone()
    sparse[1, 1:] = 5                                                # 5 of HF's 8, 4 of full's
    kv = {bench.HF: 20, "full": 40, "streaming": 5, "h2o": 6, "snapkv": 10, "rkv": 7, "blocktopk": 40}
    results = {bench.HF: [fake_run(s_, kv_tokens=kv[bench.HF], tokens=hf) for s_ in (4.0, 1.0, 2.0)]}
    results["full"] = [fake_run(s_, evict=0.0, kv_tokens=kv["full"], tokens=full) for s_ in (8.0, 0.5, 1.0)]
    for name in bench.SPARSE:                                        # choosing: 0.1 / 0.2, 0.2 / 0.4, 0.5 / 2 of decode
        results[name] = [fake_run(*t, kv[name], sparse) for t in ((0.25, 0.05, 0.1), (0.5, 0.1, 0.2), (3.0, 1.0, 0.5))]
    results = {name: bench.median_run(runs) for name, runs in results.items()}
    long = {"full": bench.median_run([fake_run(4.0, 0.5, 0.0, kv_tokens=100)]),
            bench.LONG_POLICY: bench.median_run([fake_run(1.0, 0.5, 0.25, kv_tokens=25)])}
    scale = [dict(context=64, full=2.0, snapkv=1.0, ratio=2.0)]
    over = dict(train_step_seconds=1.0, correction_seconds=0.001, rescore_seconds=0.5, rescore_vs_rollout=1.0,
                rescore_vs_dense_rollout=0.5)
    lim = dict(mm_flops=1e9, decode_flops=1e8, flops_per_token=1e6, copy_bytes_per_s=1e9, decode_bytes_per_s=1e8)
    return bench.report(s, results, long, scale, over, lim, 1.0, "fake")


def throughput_rows(text):
    """Table 1 of the printed report as {sampler: its other cells}."""
    table = text.split("### 1. Throughput")[1].split("###")[0]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in table.splitlines()
             if row.startswith("| ") and not row.startswith("| sampler")]
    return {row[0]: row[1:] for row in cells}


def test_tokens_per_second_is_batch_times_new_over_the_median_seconds():
    text, record = fake_report()
    # batch 2 x 4 new = 8 tokens a run: HF median 2 s -> 4/s, full median 1 s -> 8/s, sparse median 0.5 s -> 16/s;
    # the long rows: 2 x 8 = 16 tokens in 4 s and 1 s
    expected = {bench.HF: 4.0, "full": 8.0, **{name: 16.0 for name in bench.SPARSE}}
    assert {name: row["tokens_per_s"] for name, row in record["throughput"].items()} == expected
    assert record["throughput"]["full"]["seconds"] == [8.0, 0.5, 1.0]            # every round, the median of them used
    assert {name: row["tokens_per_s"] for name, row in record["long"].items()} == {"full": 4.0, bench.LONG_POLICY: 16.0}
    assert throughput_rows(text)["ours snapkv"][:3] == ["16.0", "4.00x", "2.00x"]


def test_the_printed_kv_and_same_token_cells_are_counted_by_hand():
    text, record = fake_report()
    rows = throughput_rows(text)
    # peak KV against ours full's 40 tokens (not HF's 20): snapkv 10 -> 0.250, streaming 5 -> 0.125, blocktopk 1
    for name, kv in (("snapkv", "0.250"), ("streaming", "0.125"), ("blocktopk", "1.000"), ("full", "1.000")):
        assert rows[f"ours {name}"][3] == kv
        assert float(kv) == record["throughput"][name]["peak_kv_bytes"] / record["throughput"]["full"]["peak_kv_bytes"]
    assert rows[bench.HF][3] == "0.500"
    # same tokens as HF, the share of positions: full 7 of 8, every sparse sampler 5 of 8 (against full: 4 of 8)
    assert rows["ours full"][5] == "0.875" and rows[bench.HF][5] == "-"
    assert all(rows[f"ours {name}"][5] == "0.625" for name in bench.SPARSE)
    assert record["throughput"]["full"]["same_tokens_as_hf"] is False and record["throughput"][bench.HF]["same_tokens_as_hf"] is None
    # the choosing cell: the median of 50 %, 50 % and 25 % of decode time
    assert rows["ours snapkv"][4] == "50.0 %" and rows["ours full"][4] == "-"


def test_the_long_rows_kv_is_against_the_long_dense_run():
    text, _ = fake_report()
    rows = throughput_rows(text)
    # long: snapkv 25 tokens of the long dense run's 100 (not the short dense run's 40)
    assert rows[f"ours {bench.LONG_POLICY}, 8 new"][3] == "0.250"
    assert rows["ours full, 8 new"][3] == "1.000"
    assert rows[f"ours {bench.LONG_POLICY}, 8 new"][2] == "4.00x"                 # 16/s against the long dense 4/s


def test_the_evict_share_is_of_decode_time_without_the_prefill():
    # decode = seconds - prefill: 4 / (10 - 2), 5 / (12 - 2), 4 / (20 - 4) -> 0.5, 0.5, 0.25: median 0.5
    # (of the whole seconds it would be 0.4, 0.417, 0.2: median 0.417)
    runs = [fake_run(10.0, 2.0, 4.0), fake_run(12.0, 2.0, 5.0), fake_run(20.0, 4.0, 4.0)]
    summary = bench.median_run(runs)
    assert summary["evict_share"] == 0.5 and summary["seconds"] == 12.0 and summary["all_seconds"] == [10.0, 12.0, 20.0]
    assert "evict_share" not in bench.median_run([fake_run(1.0)])               # HF: nothing chosen


def test_scaling_averages_the_interval_steps_ending_at_each_context_per_sequence():
    # prompt 4, interval 2, batch 2, 6 new: stamps of the prefill, decode steps 1..5 and the end. Dense step i
    # (context 4 + i) takes i + 1 s (the prefill 1 s), the eviction's every step 1 s.
    s = dict(prompt=4, interval=2, batch=2, contexts=(5, 7, 10))
    dense = [0, 1, 3, 6, 10, 15, 21]
    long = {"full": dict(stamps=dense), bench.LONG_POLICY: dict(stamps=list(range(7)))}
    table = bench.scaling(long, s)
    # context 5: step 1 only (the window would reach back to the prefill): 2 s / 2 rows = 1000 ms;
    # context 7: steps 2 and 3, (3 + 4) / 2 / 2 = 1750 ms; context 10 (prompt + new): the last step, 5, 6 / 2 = 3000 ms
    assert [row["full"] for row in table] == [1000.0, 1750.0, 3000.0]
    assert [row[bench.LONG_POLICY] for row in table] == [500.0, 500.0, 500.0]
    assert [row["ratio"] for row in table] == [2.0, 3.5, 6.0]


def test_the_limit_counts_flops_and_bytes_by_hand(monkeypatch):
    # 1 layer, 4 wide, 2 heads of 2 (1 KV head), ffn 6, vocabulary 10, batch 2, prompt 3, 2 new (4 tokens fed).
    # Weights: q 4x4 + o 4x4 + k 4x2 + v 4x2 + gate, up, down 3 x 4x6 + output 4x10 = 160 -> 320 FLOP a token;
    # attention 4 * heads * head_dim = 16 FLOP per cached token: contexts 1..4 -> 16 * 10 / 4 = 40 a token.
    s = dict(layers=1, hidden=4, heads=2, kv_heads=1, ffn=6, vocab=10, batch=2, prompt=3, new=2, mm=8)
    lim = bench.limit(s, dict(seconds=2.0), repeats=1)
    assert lim["flops_per_token"] == 360
    assert lim["decode_flops"] == 2 * 4 * 360 / 2.0                   # batch x fed tokens x 360, over 2 s
    # bytes: 2 passes (prefill, one decode step) each read 160 weights x 4 bytes; KV of contexts 3 and 4 at
    # 2 (K, V) x 1 KV head x 2 dims x 4 bytes x batch 2 = 32 bytes a token
    assert lim["decode_bytes_per_s"] == (2 * 160 * 4 + (3 + 4) * 32) / 2.0


def test_a_pretrained_models_own_head_dim_sizes_the_kv_formula_and_the_limit(monkeypatch):
    # Qwen3 sets head_dim apart from hidden / heads (0.6B: 128, not 1024 / 16 = 64); here 32, not 64 / 4 = 16. The
    # KV formula must equal the bytes the cache holds, and the limit's weights the model's matmul parameters (every
    # 2-D weight but the embedding, which a step reads a row of): with hidden / heads both were half of the truth
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         intermediate_size=128, num_hidden_layers=2, vocab_size=128)).eval()
    monkeypatch.setattr(bench, "load_pretrained", lambda name: (qwen3, None))
    s = dict(bench.PRETRAINED, model="qwen3-like", batch=2, prompt=8, new=1, mm=8)
    model = bench.build_model(s)
    _, tokens, kv_bytes, _ = bench.greedy(model, bench.random_ids(s, 2, 8), "full", 4, 16, 4)
    assert cost.kv_bytes(bench.hf_config(s), tokens, s["batch"], 4) == kv_bytes == 2 * 2 * 2 * 32 * (8 + 3) * 4 * 2
    weights = sum(w.numel() for name, w in qwen3.named_parameters() if w.dim() == 2 and "embed_tokens" not in name)
    lim = bench.limit(s, dict(seconds=1.0), repeats=1)
    # one pass (the prefill at context 8): the weights and 8 tokens of K and V a layer, in fp32
    assert lim["decode_bytes_per_s"] == 4 * (weights + 2 * 2 * 2 * 32 * 8 * 2)


# ----------------------------------------------------------------------------- the clocks, on counted ticks

def test_run_counts_every_choosing_call_and_stamps_every_pass(monkeypatch):
    # Pins run and eviction_clock on a clock that ticks once a read: each choosing call (compress, and
    # Layer.remember, patched by patch.object) takes one tick and they add up (`=` for `+=` or an unpatched
    # remember fails); a run's seconds are its 20 passes' stamps, 2 reads per choosing call and its end; the
    # stamps end with that end; HF chooses nothing (evict_seconds and stamps None) and its prefill is one tick
    ticks, calls = iter(range(10 ** 6)), []
    for module in (bench, clocks):   # run reads bench's clock, its stamps and choosing calls read clocks'
        monkeypatch.setattr(module, "clock", lambda device: float(next(ticks)))
    for owner, name in ((kvcache, "compress"), (kvcache.Layer, "remember")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, **k: (calls.append(1), _real(*a, **k))[1])
    s = dict(bench.QUICK)
    model, ids = bench.build_model(s), bench.random_ids(s, 2, s["prompt"])
    r = bench.run(model, ids, "snapkv", 20, s)
    assert len(calls) > 20 and r["evict_seconds"] == len(calls)
    assert r["seconds"] == 20 + 2 * len(calls) + 1 and len(r["stamps"]) == 21
    assert r["stamps"][-1] - r["stamps"][0] == r["seconds"] - 1        # the start is the read before the first stamp
    hf = bench.run(model, ids, bench.HF, 20, s)
    assert (hf["evict_seconds"], hf["stamps"], hf["prefill"], hf["seconds"]) == (None, None, 1.0, 21.0)


def test_run_and_greedy_pass_their_interval_and_extra_arguments_on():
    # Pins run's `interval or s["interval"]` (the interval-1 overhead rows; else the peak would be 16 + 8) and
    # greedy's **extra (bench_gpu's captured rows): record=True must reach generate, whose Rollouts then keep `kept`
    s = dict(bench.QUICK)
    model, ids = bench.build_model(s), bench.random_ids(s, 2, s["prompt"])
    assert bench.run(model, ids, "snapkv", 20, s, interval=1)["peak_kv_tokens"] == s["budget"] + 1
    assert bench.greedy(model, ids, "full", 4, s["budget"], s["interval"], record=True)[3].kept is not None


def test_the_limit_counts_its_work_on_one_tick_timings(monkeypatch):
    # Pins limit's rates (`clocks.rate`, read on `clocks.clock`): on a clock that ticks once a read every timing
    # is 1 s, so a rate is its work: mm 2 x 8^3 FLOPs (n = s["mm"]), a copy of 32 x 8 x 8 values (read + write:
    # 2 x 4 bytes each); both at the given 3 repeats (2 reads each), not copy_bandwidth's default 5
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(clocks, "clock", lambda device="cpu": float(next(ticks)))
    s = dict(layers=1, hidden=4, heads=2, kv_heads=1, ffn=6, vocab=10, batch=2, prompt=3, new=2, mm=8)
    start = next(ticks)
    lim = bench.limit(s, dict(seconds=2.0), repeats=3)
    assert lim["mm_flops"] == 2 * 8 ** 3 and lim["copy_bytes_per_s"] == 2 * 4 * 32 * 8 * 8
    assert next(ticks) - start - 1 == 2 * 3 * 2


def test_overheads_time_snapkv_and_rkv_at_interval_1_on_a_quarter_of_the_tokens(monkeypatch):
    # Pins overheads' interval-1 rows: run at interval 1 with new // 4 tokens, each a share of decode time without
    # the prefill (median_run's evict_share): 4 s of choosing in 10 s with 2 s of prefill is 0.5, not 0.4
    s = dict(bench.QUICK)
    model, ids = bench.build_model(s), bench.random_ids(s, s["batch"], s["prompt"])
    results = {name: bench.median_run([bench.run(model, ids, name, s["new"], s)])
               for name in ("full", bench.LONG_POLICY)}
    calls = []
    monkeypatch.setattr(bench, "run", lambda model, ids, name, new, s, interval=None: (
        calls.append((name, new, interval)), fake_run(10.0, 2.0, 4.0))[1])
    over = bench.overheads(model, ids, results, s, repeats=1)
    assert calls == [("snapkv", s["new"] // 4, 1), ("rkv", s["new"] // 4, 1)]
    assert over["interval_1"] == {"snapkv": 0.5, "rkv": 0.5}


def test_ratio_is_a_dash_where_a_number_is_missing():
    # Pins ratio's "-" for a missing side (a skipped row's None or 0 speed), not "0.00x" or a TypeError
    assert [bench.ratio(3.0, 2.0), bench.ratio(None, 2.0), bench.ratio(0.0, 2.0), bench.ratio(3.0, None)] == \
        ["1.50x", "-", "-", "-"]


def test_the_targets_are_counted_by_hand_and_recorded():
    # Pins report's targets: full 8/s over HF 4/s; the slowest eviction (all 16/s: streaming, the first) over full
    # 8/s; the long snapkv 16/s over the long full 4/s; choosing 50 %; correction 1 ms of a 1 s step = 0.1 %;
    # the record's targets hold the printed cells (a ratio swapped or another denominator fails)
    text, record = fake_report()
    measured = list(record["targets"].values())
    assert measured[0] == "2.00x, tokens equal: False" and measured[1] == "2.00x" and measured[3:] == [
        "4.00x", "50.0 %", "0.1000 %"]
    assert "(slowest: streaming)" in list(record["targets"])[1]
    assert all(f"| {target} | {cell} |" in text for target, cell in record["targets"].items())


def test_the_cpu_bench_names_its_processor_not_a_gpu_beside_it(monkeypatch, tmp_path):
    # bench.py (not --gpu) runs on the CPU even where CUDA is present: its label said the GPU's name there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    cores = f"({os.cpu_count()} cores)"
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n")
    monkeypatch.setattr(bench, "Path", lambda path: fake if path == "/proc/cpuinfo" else Path(path))
    assert bench.cpu_name() == f"AMD EPYC 7B13 64-Core Processor {cores}"
    fake.write_text("processor\t: 0\n")                          # no model name: "CPU"
    assert bench.cpu_name() == f"CPU {cores}"
    fake.unlink()                                                 # not Linux, or unreadable: "CPU", not an error
    assert bench.cpu_name() == f"CPU {cores}"


def test_the_slowest_eviction_the_most_choosing_the_kv_bound_and_the_disturbed_runs_by_hand():
    # Pins report's choices among unequal samplers: batch 2 x 4 new = 8 tokens a run. Seconds (prefill 0, choosing):
    # streaming 0.5 (0.05: 10 %), h2o 0.25 (0.1: 40 %), snapkv 0.4 (0.12: 30 %), rkv 0.2 (0.02: 10 %), blocktopk
    # 0.5 (0.25: 50 %, not an evicting cache). Slowest eviction: streaming, 16/s against dense's 8/s; most choosing:
    # h2o; peak KV: the largest evicting cache (snapkv's 10 tokens) of dense's 40 = 0.25, bound (16 + 8) / (16 + 4);
    # HF's run had others at 0.1 cores, "or more": disturbed; dense's 0.05 not. Memory: HF's bytes equal the formula
    # (2 x 3 layers x 2 KV heads x 16 x 20 tokens x 4 bytes x 2 rows = 30720); dense's 3 MiB (3.00, in 2^20), above
    # its formula, and snapkv's 80 bytes, below its 15360, do not
    s = dict(bench.QUICK, batch=2, new=4, long_new=8)
    timings = {bench.HF: (2.0, None, 20), "full": (1.0, 0.0, 40), "streaming": (0.5, 0.05, 5), "h2o": (0.25, 0.1, 6),
               "snapkv": (0.4, 0.12, 10), "rkv": (0.2, 0.02, 7), "blocktopk": (0.5, 0.25, 40)}
    results = {}
    for name, (seconds, evict, kv) in timings.items():
        run = fake_run(seconds, evict=evict, kv_tokens=kv)
        run["others"] = {bench.HF: 0.1, "full": 0.05}.get(name)
        results[name] = bench.median_run([run])
    results[bench.HF]["peak_kv_bytes"], results["full"]["peak_kv_bytes"] = 30720, 3 * 2**20
    long = {"full": bench.median_run([fake_run(4.0, 0.5, 0.0)]), bench.LONG_POLICY: bench.median_run([fake_run(1.0, 0.5, 0.25)])}
    over = dict(train_step_seconds=1.0, correction_seconds=0.001, rescore_seconds=0.5, rescore_vs_rollout=1.0,
                rescore_vs_dense_rollout=0.5)
    lim = dict(mm_flops=1e9, decode_flops=1e8, flops_per_token=1e6, copy_bytes_per_s=1e9, decode_bytes_per_s=1e8)
    text, record = bench.report(s, results, long, [], over, lim, 1.0, "fake")
    targets = record["targets"]
    assert targets["eviction >= 1.5x dense at 16+4 (slowest: streaming)"] == "2.00x"
    assert targets["peak KV <= (16+8)/19 of dense"] == \
        "10 of 40 tokens = 0.2500 (bound 1.2632; dense never feeds its last token)"   # 24 / 19: dense's own peak
    assert targets["choosing what to evict < 10 % of decode at interval 8 (most: h2o)"] == "40.0 %"
    assert record["disturbed_runs"] == [f"{bench.HF} 1 (0.1)"]
    memory = text.split("### 2. Memory")[1].split("###")[0]
    assert f"| {bench.HF} | 20 | 0.03 | 0.03 | yes | 0.010 |" in memory
    assert "| ours full | 40 | 3.00 | 0.06 | NO | 1.000 |" in memory
    assert "| ours snapkv | 10 | 0.00 | 0.01 | NO | 0.000 |" in memory


def test_throughput_warms_up_then_alternates_the_order_of_its_rounds(monkeypatch):
    # Pins throughput's schedule on a fake run: one warm-up of min(32, new) = 32 tokens per sampler, then round 1
    # in order, round 2 reversed (a slow drift hits no sampler always), each of new = 48; then the long rollout
    calls = []
    monkeypatch.setattr(bench, "run", lambda model, ids, name, new, s: calls.append((name, new)) or fake_run(1.0))
    names = [bench.HF, "full"] + bench.SPARSE
    results, long = bench.throughput(None, None, dict(bench.QUICK, repeats=2))
    assert calls == [(n, 32) for n in names] + [(n, 48) for n in names + names[::-1]] + \
        [("full", 120), (bench.LONG_POLICY, 120)]
    assert list(results) == names and results["full"]["all_seconds"] == [1.0, 1.0] and list(long) == ["full", "snapkv"]


def test_random_ids_never_draw_the_pad_id():
    # Pins random_ids' range: ids from 1 (0 is the pad id); a vocabulary of 2 leaves only id 1
    ids = bench.random_ids(dict(vocab=2), 4, 100)
    assert ids.shape == (4, 100) and bool((ids == 1).all())


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--out", "b.md"], "error: --out 'b.md': it names the JSON, and the tables go beside it as "
                                   ".md: give a .json name (--gpu writes the markdown)"),
    (["--gpu", "--quick", "--out", "g.json"], "error: --out 'g.json': with --gpu it names the markdown, and "
                                              "the JSON goes beside it as .json: give a .md name")],
    ids=["json-as-md", "gpu-markdown-as-json"])
def test_an_out_that_the_other_file_would_overwrite_is_refused(tmp_path, monkeypatch, capsys, argv, message):
    # bench.py --gpu --out g.json wrote its markdown there, then the JSON over it: the tables silently gone
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert capsys.readouterr().err.splitlines()[-1].split(": ", 1)[1] == message   # after the program's name
    assert not any(tmp_path.iterdir())


def test_median_run_keeps_the_first_runs_tokens_and_stamps_and_every_runs_load():
    # Pins median_run's sources, by hand on 3 runs told apart: tokens, cache size, prefill and stamps are the first
    # run's (the scaling table reads its stamps), not the last's; the others' load is every run's, in order (the
    # disturbed runs are named by their run number), not the first's alone
    runs = [fake_run(3.0, 1.0, 0.5, kv_tokens=k, tokens=torch.full((2, 4), k)) for k in (7, 8, 9)]
    for i, r in enumerate(runs):
        r["stamps"], r["others"] = [10 * i, 10 * i + 1], [None, 0.2, 0.05][i]
    summary = bench.median_run(runs)
    assert summary["peak_kv_tokens"] == 7 and bool((summary["tokens"] == 7).all()) and summary["stamps"] == [0, 1]
    assert summary["all_others"] == [None, 0.2, 0.05]


def test_scaling_marks_a_context_no_decode_step_reaches_as_missing():
    # Pins scaling's nan: at prompt 4 a context of 4 (the prompt alone) ends no decode step, so its time is not a
    # measurement: nan, not 0.0 ms (a decode step that cost nothing); context 5 is step 1, 2 s / 2 rows = 1000 ms
    s = dict(prompt=4, interval=2, batch=2, contexts=(4, 5))
    long = {name: dict(stamps=[0, 1, 3, 6]) for name in ("full", bench.LONG_POLICY)}
    table = bench.scaling(long, s)
    assert math.isnan(table[0]["full"]) and table[1]["full"] == 1000.0


def test_the_long_rows_choosing_cell_is_the_long_evicting_runs_share():
    # Pins report's long rows' choosing cell: the long snapkv run chose 0.25 s of 1 - 0.5 s of decode = 50.0 %;
    # the long dense run chooses nothing: "-"
    rows = throughput_rows(fake_report()[0])
    assert rows[f"ours {bench.LONG_POLICY}, 8 new"][4] == "50.0 %" and rows["ours full, 8 new"][4] == "-"


def test_the_overhead_and_limit_rows_and_hfs_share_are_counted_by_hand():
    # Pins report's table 4 and 5 cells on fake_report: every sparse sampler has a choosing row (block top-k's
    # "pages, every step", an evicting one's "evict, interval 8"), each the median 50.0 % of decode; the limit's
    # fraction is ours over the machine's, 1e8 / 1e9 = 10.0 %; HF chooses nothing: its evict_share is None, not 0
    text, record = fake_report()
    assert "| choosing, blocktopk (pages, every step) | - | decode time | 50.0 % |" in text
    assert "| choosing, rkv (evict, interval 8) | - | decode time | 50.0 % |" in text
    assert "| 0.10 G (1.0 MFLOP/token) | 10.0 % |" in text and record["throughput"][bench.HF]["evict_share"] is None


def test_main_takes_the_settings_of_its_flags(monkeypatch):
    # Pins main's settings: --repeats 1 reaches the runs (not QUICK's 2); --model takes PRETRAINED's runs (budget
    # 128), not FULL's (budget 256)
    class Built(Exception):
        pass

    def build_model(s):
        raise Built(dict(s))
    monkeypatch.setattr(bench, "build_model", build_model)
    monkeypatch.setattr(bench, "check_out_file", lambda out: None)
    monkeypatch.setattr(bench, "out_files", lambda out, gpu: [out, out, out])
    with pytest.raises(Built) as built:
        bench.main(["--quick", "--repeats", "1"])
    assert built.value.args[0]["repeats"] == 1
    with pytest.raises(Built) as built:
        bench.main(["--model", "m"])
    assert built.value.args[0]["budget"] == bench.PRETRAINED["budget"] == 128 and built.value.args[0]["model"] == "m"


def test_a_deadline_goes_with_gpu_only_and_may_be_zero(monkeypatch, capsys, tmp_path):
    # Pins main's --deadline check: without --gpu it is refused by name; with --gpu, 0 (skip every row not begun)
    # reaches bench_gpu, as any value >= 0 does
    import bench_gpu
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_gpu, "main", lambda args: args.deadline)
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--deadline", "5"])
    assert "--deadline goes with --gpu and must be >= 0, got 5.0 without --gpu" in capsys.readouterr().err
    assert bench.main(["--gpu", "--quick", "--deadline", "0"]) == 0.0
