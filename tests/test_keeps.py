"""keeps.py: the shares of layers and heads that hold each position, against the cache's own history on a tiny
warm-up; the table's shares on stubbed kept fractions; the errors, each before any model is loaded."""
import json
import sys

import pytest
import torch

import keeps
import train
from kvcache import SparseConfig
from test_train import SMALL


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "--budget must be >= 1, got 0$"),
    (["--example", "-1"], "--example must be >= 0, got -1$"),
    (["--out", ""], "--out is empty: give a value, or leave the flag out"),              # was: ./.png
    (["--out", "."], "--out '.' is a folder; give a file name \\(a .png\\)"),      # was: ./..png
    # was "so none is compressed at its prefill": the prefill is kept whole (docs/method.md section 2)
    (["--budget", "1000"], "--budget 1000: no held-out prompt is longer than the budget \\+ interval "
                           "\\(4\\), so none is compressed at the first decode step: give a smaller --budget$"),
])
def test_bad_flags_are_refused_before_loading(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)                     # --out's default folder, out/, is made before some refusals
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4], seed=0)))
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=message):
        keeps.main(argv + ["--model", str(tmp_path)])


@pytest.mark.parametrize("text, message", [                        # models.toy_settings' cases: tests/test_models.py
    ("{bad", "cannot read .*warmup.json: Expecting"),
    ('{"task": "pick", "digits": [3, 4]}', "holds no toy run's settings: a JSON object with task, digits, seed$"),
])
def test_a_warmup_json_that_holds_no_warm_up_is_named(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)                     # --out's default folder, out/, is made before some refusals
    (tmp_path / "warmup.json").write_text(text)                       # each was a traceback or an unnamed JSON error
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match=message):
        keeps.main(["--model", str(tmp_path)])


def test_without_a_warm_up_the_folder_and_the_one_to_pass_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # --out's default folder, out/, is made before some refusals
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "args.json").write_text('{"task": "pick", "digits": [3, 6], "seed": 0}')   # a run's: no warm-up
    with pytest.raises(SystemExit, match=f"^error: --model '{tmp_path}' holds no warmup.json: give the folder of a "
                                         "toy warm-up \\(`python train.py` makes out/warmup\\)$"):
        keeps.main(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match=f"^error: --model '{tmp_path / 'x'}': no such folder; run `python train.py`"):
        keeps.main(["--model", str(tmp_path / "x")])


def test_an_out_under_a_file_is_one_clear_line_before_the_work(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(keeps, "keeps", lambda args: pytest.fail("the work started"))
    with pytest.raises(SystemExit, match="^error: .*File exists"):
        keeps.main(["--out", str(tmp_path / "afile" / "k.png")])


def test_draws_to_out_by_default():
    # Pins the default --out: out/keeps.png, not the committed results/keeps.png a bare run overwrote
    assert keeps.parse_args([]).out == "out/keeps.png"


def test_help_shows_the_value_each_flag_takes(capsys):
    # STYLE: `--help` shows the value each flag will take. argparse prints a default only beside a help text, so
    # --policies showed none
    defaults = {k: v for k, v in vars(keeps.parse_args([])).items() if v is not None}
    with pytest.raises(SystemExit):
        keeps.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())                  # argparse wraps its lines anywhere
    for name, value in defaults.items():
        assert f"(default: {value})" in text, name


def test_without_matplotlib_the_png_is_named_in_one_warning_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                  # import matplotlib now fails
    keeps.draw_keeps([], [], {}, 6, tmp_path / "keeps.png")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: matplotlib is not installed")
    assert "keeps.png not written" in err[0] and not (tmp_path / "keeps.png").exists()


def test_counts_the_layers_and_heads_that_hold_each_position(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "run"
    train.main(SMALL + ["--steps", "0", "--out", str(folder)])          # makes the small sort warm-up
    model, tokenizer = keeps.load_pretrained(str(folder / "warmup"))
    sparse = SparseConfig("snapkv", 10, 2, 2, 2)
    prompt = "S" + "31415926" + "="
    kept, tokens = keeps.kept_fractions(model, tokenizer, prompt, sparse, 10)
    # the same from what the sampler recorded, by hand: a position counts where a (layer, head) holds it
    out = keeps.generate(model, [keeps.encode_prompt(tokenizer, prompt)], sparse, 10, temperature=0,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, record=True)
    assert 0 < len(tokens) and tokens == out.tokens[0][out.mask[0] > 0].tolist()   # the whole answer, its last too
    history = out.kept                                                   # per layer [steps, 1, H_kv, S]
    for step in range(kept.shape[0]):
        for position in range(kept.shape[1]):
            held = [position in layer[step][0, h].tolist() for layer in history for h in range(layer[step].shape[1])]
            assert kept[step, position].item() == pytest.approx(sum(held) / len(held))
    assert kept[-1, -3:].tolist() == [1.0, 1.0, 0.0]    # the window held; the last token is sampled, never fed
    assert (kept[1:] < 1).any()                                          # and something was evicted
    keeps.main(["--model", str(folder / "warmup"), "--policies", "snapkv", "streaming", "--budget", "6",
                "--out", str(tmp_path / "keeps.png")])
    assert (tmp_path / "keeps.png").read_bytes()[:4] == b"\x89PNG"
    assert "| streaming |" in capsys.readouterr().out


def test_takes_train_s_held_out_prompts_and_the_shares_of_the_last_step(tmp_path, monkeypatch, capsys):
    # no model: the held-out examples and the kept fractions are stubbed. Prompt "Pabc123de=" (+ BOS at 0):
    # digits at positions 5-7 are needed, the lower-case letters 2-4, 8, 9 distractors.
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4], seed=7)))
    made, drawn = [], []

    def held_out_examples(task, n, seed, *digits):
        made.append((task, n, seed, digits))                        # only the second and third are longer than
        return [dict(prompt="P12=", answer="1"), dict(prompt="Pabc123de=", answer="2"),   # budget 6 + interval 4
                dict(prompt="Pxyz999xy=", answer="9")]
    kept = torch.ones(3, 13)                                        # steps 0 (prefill), 1, 2; 11 prompt + 2 answer
    kept[1, 5:8] = 0                                                # step 1: no needed token held
    kept[2] = torch.tensor([1, 1, 0, 0, .25, 1, 1, .25, .5, .5, 1, 1, 1])
    tokenizer = type("T", (), dict(decode=lambda self, tokens, skip_special_tokens: "7"))()
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: (None, tokenizer))
    monkeypatch.setattr(keeps, "held_out_examples", held_out_examples)
    monkeypatch.setattr(keeps, "kept_fractions", lambda model, tok, prompt, sparse, new: (drawn.append(prompt), (kept, [5]))[1])
    monkeypatch.setattr(keeps, "draw_keeps", lambda *a: None)
    keeps.main(["--model", str(tmp_path), "--policies", "snapkv", "--budget", "6", "--out", str(tmp_path / "k.png")])
    assert made == [("pick", 256, 7, (3, 4))]                       # train.py's held-out set for seed 7
    assert drawn == ["Pabc123de="]
    # the last step: needed (1 + 1 + .25) / 3 = 75 %; distractors (0 + 0 + .25 + .5 + .5) / 5 = 25 %
    assert "| snapkv | '7' | 75% | 25% |" in capsys.readouterr().out


def test_a_task_without_distractors_shows_none_held_as_a_dash(tmp_path, monkeypatch, capsys):
    # sort's prompt "S31415926=" has no lower-case letter: the share of distractors held is of no token, and the
    # table printed "nan%". The needed digits (positions 2-9, after BOS and the marker) hold 6 of 8 at the last step
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="sort", digits=[4, 8], seed=0)))
    kept = torch.ones(2, 13)                                        # steps 0 (prefill) and 1; 11 prompt + 2 answer
    kept[1, 3:5] = 0
    tokenizer = type("T", (), dict(decode=lambda self, tokens, skip_special_tokens: "7"))()
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: (None, tokenizer))
    monkeypatch.setattr(keeps, "held_out_examples", lambda *a: [dict(prompt="S31415926=", answer="11345699")])
    monkeypatch.setattr(keeps, "kept_fractions", lambda *a: (kept, [5]))
    monkeypatch.setattr(keeps, "draw_keeps", lambda *a: None)
    keeps.main(["--model", str(tmp_path), "--policies", "snapkv", "--budget", "6", "--out", str(tmp_path / "k.png")])
    assert "| snapkv | '7' | 75% | - |" in capsys.readouterr().out


def test_a_policy_named_twice_is_one_panel(tmp_path, monkeypatch, capsys):
    # --policies snapkv h2o snapkv decoded snapkv twice and drew and printed it twice: one panel and row a policy
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4], seed=0)))
    ran, drawn = [], []
    tokenizer = type("T", (), dict(decode=lambda self, tokens, skip_special_tokens: "7"))()
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: (None, tokenizer))
    monkeypatch.setattr(keeps, "held_out_examples", lambda *a: [dict(prompt="Pabc123de=", answer="123")])
    monkeypatch.setattr(keeps, "kept_fractions", lambda m, t, p, sparse, n: (ran.append(sparse.policy),
                                                                             (torch.ones(2, 13), [5]))[1])
    monkeypatch.setattr(keeps, "draw_keeps", lambda panels, *a: drawn.extend(p[0] for p in panels))
    keeps.main(["--model", str(tmp_path), "--policies", "snapkv", "h2o", "snapkv", "--budget", "6",
                "--out", str(tmp_path / "k.png")])
    assert ran == drawn == ["snapkv", "h2o"]
    assert capsys.readouterr().out.count("| snapkv |") == 1


def test_example_picks_among_the_long_prompts_and_one_past_them_is_named(tmp_path, monkeypatch, capsys):
    # Pins keeps' --example: the Nth of the held-out prompts longer than budget + interval (here 2 of 4: "P12="
    # is short, and "Pab12cde=", BOS + 9 = 10 tokens, is no longer than 6 + 4: `>=` for `>` counted it), and
    # --example 2, one past them, is one clear line (`>` for `>=` was an IndexError traceback)
    # before the model loads. Pins too the cache each panel is drawn through: the task's interval 4, window 4,
    # sink 2 (pick's, train.py's) at --budget 6, the task's max_new_tokens 12, and the answer decoded without
    # its special tokens (an end of sequence is no part of the answer)
    (tmp_path / "warmup.json").write_text(json.dumps(dict(task="pick", digits=[3, 4], seed=0)))
    decode = lambda self, tokens, skip_special_tokens: "7" if skip_special_tokens else "7</s>"
    tokenizer = type("T", (), dict(decode=decode))()
    monkeypatch.setattr(keeps, "held_out_examples", lambda *a: [dict(prompt="P12=", answer="1"),
                                                                dict(prompt="Pab12cde=", answer="12"),
                                                                dict(prompt="Pabc123de=", answer="2"),
                                                                dict(prompt="Pxyz999xy=", answer="9")])
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    argv = ["--model", str(tmp_path), "--policies", "snapkv", "--budget", "6", "--out", str(tmp_path / "k.png")]
    with pytest.raises(SystemExit, match="^error: --example 2: only 2 held-out prompts are longer than the budget "
                                         "\\(6\\) \\+ interval \\(4\\)$"):
        keeps.main(argv + ["--example", "2"])
    ran = []
    monkeypatch.setattr(keeps, "load_pretrained", lambda *a, **k: (None, tokenizer))
    monkeypatch.setattr(keeps, "kept_fractions", lambda model, tok, prompt, sparse, new:
                        (ran.append((prompt, sparse, new)), (torch.ones(2, 13), [5]))[1])
    monkeypatch.setattr(keeps, "draw_keeps", lambda *a: None)
    keeps.main(argv + ["--example", "1"])
    assert ran == [("Pxyz999xy=", SparseConfig("snapkv", 6, 4, 4, 2), 12)]
    assert "| snapkv | '7' | 100% | 100% |" in capsys.readouterr().out


def test_draw_keeps_colours_each_position_by_role_and_fades_it_by_its_share(tmp_path, monkeypatch):
    # Pins draw_keeps' dots, drawn into a stand-in for matplotlib: one row of dots per position, coloured by its
    # role (BOS and the marker grey, a digit green, a letter red, the answer past the prompt blue) and as opaque as
    # the share of layers and heads that hold it at each step (a share read off another position, or the last
    # prompt token drawn as the answer, fails here)
    pytest.importorskip("matplotlib")
    dots = []

    class Axes:
        xaxis = type("X", (), dict(set_major_locator=lambda self, locator: None))()

        def scatter(self, xs, ys, c, s=None, alpha=None, linewidths=None, label=None):
            if label is None:                                              # the legend's empty scatters aside
                dots.append((ys[0], c, [round(float(a), 6) for a in alpha], list(xs)))

        def __getattr__(self, name):                                      # titles, labels, legend
            return lambda *a, **k: None

    class Figure:
        def __getattr__(self, name):                                      # suptitle, tight_layout, savefig
            return lambda *a, **k: None

    class Plt:
        def subplots(self, rows, columns, **kwargs):
            return Figure(), [[Axes() for _ in range(columns)]]

        def close(self, fig):
            pass
    monkeypatch.setattr(keeps, "pyplot", lambda paths: Plt())
    kept = torch.tensor([[1, 1, 1, 1, 0], [1, .5, 0, .25, 1]])                # steps 0 and 1; 4 prompt + 1 answer
    keeps.draw_keeps([("snapkv", kept, "7")], ["prompt", "needed", "distractor", "prompt"],
                     dict(prompt="1a=", answer="7"), 6, tmp_path / "k.png")
    assert dots == [(0, "tab:grey", [1, 1], [0, 1]), (1, "tab:green", [1, .5], [0, 1]),
                    (2, "tab:red", [1, 0], [0, 1]), (3, "tab:grey", [1, .25], [0, 1]),
                    (4, "tab:blue", [0, 1], [0, 1])]
