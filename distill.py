"""DistillSparse: a LoRA adapter that teaches the sparse sampler to agree with the dense policy
(Sparrow section 5, Algorithm 1; docs/method.md section 6).

One model, two policies. The dense policy is the base weights `theta` with full attention: the
learner, the re-scoring (pi_old) and the dense evaluation, always with the adapter off. The sparse
sampler is `theta + phi` with a compressed cache: `phi`, a low-rank adapter on every linear layer
of the decoder, is on while sampling. Each RL step first updates `theta` as usual (the adapter off,
and frozen: it is not among the model's parameters), then `phi` on the same rollouts, `theta`
frozen, with a forward that uses the SAME sparsity the sampler used:

    L_phi = L_PPO,sparse + lambda * KL        (--distill ppo-kl; --distill kl keeps the KL alone)

KL is k3 between the sparse+LoRA log-probs and the dense old log-probs (detached) of the sampled
tokens, token-mean, lambda 1e-3 (Sparrow's configuration); the KL alone has coefficient 1, as Sparrow's.
The sparse training forward is the dense forward under a 4D mask that hides, for each response
token, what the sampler's cache had not kept when it sampled that token (for block top-k: the pages
it did not choose): eviction equals masking, so with the adapter the sampler had, it reproduces the
sampler's own log-probs (tested).

    lora = LoRA(model, rank=8)                        # B = 0: the adapter starts as the identity
    with lora.on():                                   # theta + phi, for both
        rollouts = generate(model, prompts, sparse, record=True)   # record: what each step saw
        logp = sparse_logprobs(model, rollouts)       # the sampler's sparsity, with grad
    loss, stats = distill_loss(logp, rollouts, logp_old, advantages)

The adapter is applied on the fly, by forward hooks on the linear layers, never merged into the
weights: merging and unmerging in floating point would not give the dense policy back bit for bit.
It lives beside the model, so `save_pretrained` writes the plain policy; `save` / `load` keep the
adapter in a safetensors file of its own.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AttentionInterface

import correction as C
from models import autocast, write_file_atomically

LAMBDA = 1e-3       # Sparrow's dense_kl_loss_coef
ALPHA = 16          # Sparrow's sparse_lora_alpha; the scale of the update is alpha / rank
LR_SCALE = 5.0      # Sparrow's lr_scale_factor: the adapter learns at 5x the base learning rate


def saved_rank(saved):
    """The rank of a saved adapter {name: tensor}: the rows of its A matrices [rank, in]; None if it holds none."""
    return next((v.shape[0] for k, v in saved.items() if k.startswith("A.")), None)


def check_rank(model, rank):
    """A ValueError unless `rank` is a positive integer no wider than `model`'s widest decoder linear layer
    (min(in, out)): a wider adapter adds nothing, and a huge one fails in torch's allocator."""
    most = max(min(m.in_features, m.out_features) for m in model.get_decoder().modules() if isinstance(m, nn.Linear))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= most:
        raise ValueError(f"the LoRA rank (--lora-rank) must be an integer from 1 to {most} (min(in, out) of the "
                         f"model's widest linear layer), got {rank!r}")


class LoRA(nn.Module):
    """A low-rank adapter phi on every linear layer of the model's decoder (not the output layer).

    Layer W (out x in) gets `W x + (alpha / rank) * B A x`, with A [rank, in] initialised as in
    PEFT (Kaiming-uniform) and B [out, rank] zero, so the adapter starts as the identity. A is drawn from
    its own generator seeded with `seed`, on the CPU: the same start whatever drew before it (a warm-up made
    or found cached) and on any device. Off by default: while off, the hooks return nothing and the model
    computes exactly its plain forward.
    """

    def __init__(self, model, rank, alpha=ALPHA, seed=0):
        super().__init__()
        check_rank(model, rank)                                        # before allocating [rank, in] per layer
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
            raise ValueError(f"the LoRA alpha must be a positive number (Sparrow's: {ALPHA}), got {alpha!r}")
        self.rank, self.alpha, self.scaling, self.active = rank, alpha, alpha / rank, False
        self.A, self.B, self.handles = nn.ParameterDict(), nn.ParameterDict(), []
        generator = torch.Generator().manual_seed(seed)
        for name, linear in model.get_decoder().named_modules():
            if isinstance(linear, nn.Linear):
                key = name.replace(".", "/")                            # "." is not allowed in a key
                A = nn.init.kaiming_uniform_(torch.empty(rank, linear.in_features), a=math.sqrt(5), generator=generator)
                self.A[key] = nn.Parameter(A.to(linear.weight.device))
                self.B[key] = nn.Parameter(torch.zeros(linear.out_features, rank, device=linear.weight.device))
                self.handles.append(linear.register_forward_hook(self.hook(key)))

    def hook(self, key):
        def add_update(linear, inputs, output):
            if self.active:   # fp32 (under autocast: bf16, as PEFT's LoRA), added in the layer's dtype
                update = inputs[0].float() @ self.A[key].t() @ self.B[key].t() * self.scaling
                return output + update.to(output.dtype)
        return add_update

    @contextmanager
    def on(self):
        """The sparse sampler: theta + phi for the duration of a block (a nested block leaves it on)."""
        outer, self.active = self.active, True      # restore, not switch off: an inner block ends inside an outer
        try:
            yield self
        finally:
            self.active = outer

    def remove(self):
        """Take the hooks off the model's layers: it runs its plain forward again, on or off."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def tensors(self):
        """{"A.<layer>": A, "B.<layer>": B}: what a file holds."""
        return {f"{part}.{key}": p for part, params in (("A", self.A), ("B", self.B)) for key, p in params.items()}

    def save(self, path):
        """A and B as safetensors, alpha in the file's metadata: the same alpha / rank comes back. Written beside
        `path`, then renamed onto it: a save cut short (a full disk, a kill) keeps the file that was there whole."""
        tensors = {k: p.detach().contiguous() for k, p in self.tensors().items()}
        # float: repr(np.float64(16.0)) reads back as no number
        metadata = {"alpha": repr(float(self.alpha))}
        write_file_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    @staticmethod
    def read(path):
        """(tensors, alpha) of the adapter file at `path`; alpha is Sparrow's where the file names none."""
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, float((f.metadata() or {}).get("alpha", ALPHA))

    @staticmethod
    def from_file(model, path):
        """The adapter saved at `path` (its rank and alpha read from the file), attached to `model`; a ValueError
        naming the file where it is no adapter of this model."""
        lora = None
        try:
            saved, alpha = LoRA.read(path)
            lora = LoRA(model, rank=saved_rank(saved), alpha=alpha)
            lora.put(saved, alpha, path)
        except Exception as error:   # safetensors' own error type, another model's layers or shapes
            if lora is not None:     # the model is left as it was: no hook of the refused adapter stays on it
                lora.remove()
            raise ValueError(f"{path} is not a DistillSparse adapter of this model (adapter.safetensors of a "
                             f"train.py --distill checkpoint): {type(error).__name__}: {error}") from None
        return lora

    def load(self, path):
        """Put the adapter saved at `path` in place; a ValueError naming the file unless it holds this adapter's
        rank, alpha, layers and shapes (copy_ would broadcast an A of [rank, 1] into [rank, in] without a word)."""
        try:
            saved, alpha = LoRA.read(path)
        except Exception as error:   # not a safetensors file, or a truncated one
            raise ValueError(f"cannot read {path}: {type(error).__name__}: {error}") from None
        self.put(saved, alpha, path)

    def put(self, saved, alpha, path):
        """Copy in the tensors `LoRA.read` got from `path` (named in the errors), after the checks `load` names."""
        mine = self.tensors()
        if (rank := saved_rank(saved)) is None:   # not "rank None": no --lora-rank would fit it
            raise ValueError(f"{path} holds no adapter: none of its {len(saved)} tensors is an A.<layer> (rank x in)")
        if rank != self.rank:
            raise ValueError(f"{path} holds a rank-{rank} adapter, this one has rank {self.rank} (train.py: resume "
                             "with the --lora-rank it was trained with)")
        if alpha != self.alpha:
            raise ValueError(f"{path} holds an adapter of alpha {alpha}, this one has alpha {self.alpha}")
        for k, p in mine.items():   # the same layers in the same shapes, nothing more
            if k not in saved or saved[k].shape != p.shape:
                raise ValueError(f"{path} holds an adapter of another model: no {k} of shape {list(p.shape)}")
        if len(saved) != len(mine):
            raise ValueError(f"{path} holds an adapter of another model: {len(saved)} tensors, this one {len(mine)}")
        with torch.no_grad():
            for k, p in mine.items():
                p.copy_(saved[k])


# ----------------------------------------------------------------------------- the sparse training forward

class SparseMasks:
    """What each query of the training forward may see: `masks[layer]` is that layer's [N, H_kv, L, L]
    bool, L = max P + T, built when the layer's attention asks for it and dropped after it (all layers
    at once would hold layers x H_kv x L^2 bools a row: ~4 GB at Qwen3-1.7B, 28 layers, L ~4300).

    The training forward lays each row out as prompt + response with natural positions (as
    `correction.response_logprobs` does), so a key's coordinate is its position. A prompt query
    saw what the prefill saw (causal); the query at coordinate P_i + t - 1 predicted response token
    t, at the step that fed token t - 1: it sees the positions `rollouts.kept` recorded for that step.
    """

    def __init__(self, rollouts):
        if rollouts.kept is None:
            raise ValueError("the sparse forward needs what the sampler kept: generate(..., record=True)")
        N, T = rollouts.tokens.shape
        self.kept, self.L = rollouts.kept, max(map(len, rollouts.prompts)) + T
        device = self.kept[0].device
        lengths = torch.tensor([len(p) for p in rollouts.prompts], device=device)
        coord = torch.arange(self.L, device=device)
        self.step = (coord[None] - lengths[:, None] + 1).clamp(min=0, max=self.kept[0].shape[0] - 1)   # [N, L]
        self.row = torch.arange(N, device=device)[:, None]                                           # [N, 1]
        self.causal = coord[:, None] >= coord[None]                        # [L, L]: key j at or before query i

    def __getitem__(self, layer):
        L, device = self.L, self.causal.device
        seen = self.kept[layer][self.step, self.row].transpose(1, 2).long()   # [steps, N, H_kv, S] -> [N, H_kv, L, S]
        rows = torch.zeros(*seen.shape[:3], L + 1, dtype=torch.bool, device=device)
        rows.scatter_(-1, torch.where(seen < 0, L, seen.clamp(max=L)), True)          # column L: "nothing"
        return (rows[..., :L] & self.causal) | torch.eye(L, dtype=torch.bool, device=device)


def masked_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             layer_masks=None, sliding_window=None, **kwargs):
    """transformers attention function "sparse_masked": SDPA under this layer's [N, H_kv, L, L] mask.

    query [N, H, L, D], key and value [N, H_kv, L, D]. Each KV head with its G = H / H_kv query heads is
    one batch entry of SDPA, [N * H_kv, G, L, D] against K, V [N * H_kv, 1, L, D] expanded (stride 0) to G heads
    and the mask [N * H_kv, 1, L, L], broadcast: neither is copied G times (query head h uses KV head h // G).
    Every query also sees its own key (the sampler always kept it), so no row is all masked:
    padding rows stay finite and carry no gradient into the loss.
    """
    mask = layer_masks[module.layer_idx]
    if sliding_window is not None:                                       # Mistral: as the sampler's mask
        coord = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (coord[None] > coord[:, None] - sliding_window)
    (N, H, L, D), H_kv = query.shape, key.shape[1]
    G = H // H_kv
    # expanded, not repeated: G heads of stride 0 (SDPA's fused kernels want as many K, V heads as query heads)
    group = lambda x: x.reshape(N * H_kv, 1, L, D).expand(-1, G, -1, -1)
    out = F.scaled_dot_product_attention(query.reshape(N * H_kv, G, L, D), group(key), group(value),
                                         attn_mask=mask.reshape(N * H_kv, 1, L, L), scale=scaling)
    return out.reshape(N, H, L, D).transpose(1, 2), None


AttentionInterface.register("sparse_masked", masked_attention_forward)


def sparse_logprobs(model, rollouts, temperature=1.0):
    """log-probs [N, T] of the sampled tokens under the model as it is now (theta + phi when the adapter
    is on), attending to exactly what the sampler's cache let each token see; with grad."""
    masks, config = SparseMasks(rollouts), model.config
    recorded = len(masks.kept), masks.kept[0].shape[2]                 # layers, KV heads
    ours = config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if recorded != ours:   # else an IndexError or a reshape's error deep in the forward
        raise ValueError(f"the rollouts were recorded by a model of {recorded[0]} layers x {recorded[1]} KV heads, "
                         f"this one has {ours[0]} x {ours[1]}: record them with the model being trained")
    previous = model.config._attn_implementation
    model.set_attn_implementation("sparse_masked")
    try:
        return C.response_logprobs(model, rollouts, temperature, layer_masks=masks)
    finally:
        model.set_attn_implementation(previous)


# ----------------------------------------------------------------------------- the adapter's loss and step

def distill_loss(logp, rollouts, logp_old, advantages, variant="ppo-kl", lam=LAMBDA):
    """L_phi of Sparrow's Algorithm 1 over the response tokens, token-mean; -> (loss, stats: kl, tokens).

    logp [N, T]: sparse+LoRA log-probs (with grad); logp_old [N, T]: the dense old policy's (detached);
    advantages [N]. KL = k3(pi_old dense / pi_sparse+phi), token-mean.
      "ppo-kl": the PPO loss of the sparse sampler + lam * KL. Its old policy is this forward's own
                log-probs, detached (Sparrow, on-policy: `old_log_prob = log_prob.detach()`), so the
                ratio is exactly 1, the clip never acts and the term is -A * grad log pi_sparse+phi;
      "kl":     the KL alone, coefficient 1 (Sparrow's `disable_policy_gradient`: loss = kl). `lam` is
                not used: gradient clipping and Adam's epsilon are not scale-invariant, so a KL scaled
                by 1e-3 would barely move the adapter.
    Every sampled token counts, rejected or not: the tokens where the two policies disagree are
    the ones to teach.
    """
    if variant not in ("ppo-kl", "kl"):
        raise ValueError(f"the distillation variant must be 'ppo-kl' or 'kl', got {variant!r}")
    if variant == "ppo-kl" and not 0 <= lam < math.inf:   # NaN too; policy_loss would name it kl_coef, not lam
        raise ValueError(f"lam, the KL term's weight, must be a finite number >= 0, got {lam}")
    C.check_shapes(logp=logp, logp_old=logp_old)          # policy_loss would name it logp_ref
    if variant == "kl":
        advantages, lam = torch.zeros_like(advantages), 1.0
    loss, stats = C.policy_loss(logp, logp.detach(), advantages, rollouts.mask, kl_coef=lam, logp_ref=logp_old,
                                agg="token-mean")
    return loss, dict(kl=stats["kl"], tokens=stats["tokens"])


def step(model, lora, opt, rollouts, logp_old, advantages, args):
    """One AdamW step of the adapter on a step's rollouts, `theta` frozen, `--micro-batch` rows per forward
    with the gradients accumulated (each part weighted by its share of the tokens); -> metrics."""
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    total = int((rollouts.mask > 0).sum()) or 1
    loss_sum, kl_sum = 0.0, 0.0
    try:
        for rows in torch.arange(len(rollouts), device=logp_old.device).split(args.micro_batch):
            part = rollouts.select(rows)
            with lora.on(), autocast(args.dtype, model.device):       # the forward; backward outside
                logp = sparse_logprobs(model, part, args.temperature)
            loss, stats = distill_loss(logp, part, logp_old[rows], advantages[rows], args.distill,
                                       args.distill_lambda)
            (loss * stats["tokens"] / total).backward()
            loss_sum += loss.item() * stats["tokens"] / total
            kl_sum += stats["kl"] * stats["tokens"] / total
        torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return dict(distill_loss=loss_sum, distill_kl=kl_sum)
