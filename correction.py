"""Off-policy correction for sparse rollouts, the GRPO loss and rollout down-sampling.

A sparse rollout is sampled by pi_sparse (compressed KV cache) but trained as if it came from
the dense policy, so three policies disagree (docs/method.md section 1). This module is the trainer's
answer, function by function in the order of one training step:

- re-scoring: `dense_logprobs` (pi_old, no grad) and `response_logprobs` (pi_theta, with grad)
  score the sampled tokens under the full prefix (section 1);
- measuring: `rho = pi_old / pi_sparse`, the acceptance `alpha = 1 - TV` and KL estimators,
  gathered by `mismatch_stats` (section 4);
- correcting: Sparse-RL's `rejection_mask` (sequence veto + token band) and truncated
  `importance_weights` (section 5);
- learning: `group_advantages` and the clipped `policy_loss` (sections 5 and 8);
- saving work: PODS `downsample` keeps the m most informative of n rollouts per prompt (section 7).

    logp_old, topk_old = dense_logprobs(model, rollouts, batch_size=8, temperature=1.0, topk=True)
    log_rho = logp_old - rollouts.logprobs
    stats = mismatch_stats(logp_old, rollouts.logprobs, rollouts.mask, topk_old, rollouts.topk_logprobs)
    mask, reject_stats = rejection_mask(log_rho, rollouts.mask)
    weights = importance_weights(log_rho, rollouts.mask)
    advantages, adv_stats = group_advantages(rewards, group_size=8)
    loss, loss_stats = policy_loss(response_logprobs(model, rollouts), logp_old, advantages, mask, weights,
                                   response_mask=rollouts.mask)   # the denominators: the tokens as sampled

Every function is pure: tensors in, tensors (and a dict of plain-number stats) out.
Shapes: N responses, T response tokens (right-padded), k top-k entries, V vocabulary.
"""
import numpy as np
import torch

CHUNK_ELEMENTS = 2 ** 27  # re-scoring's vocabulary-sized tensors: at most this many fp32 values a chunk (512 MiB)
LOG_RHO_CLAMP = 20.0  # rho = exp(clamp(log rho, -20, 20)) keeps every ratio finite (docs/method.md section 1)
# alpha sums min(p_dense, p_sparse) over the sampler's top-k tokens: exact when k covers the vocabulary, a lower
# bound below it. Training, evaluation and calibration all use this k, so one threshold (0.86) means one thing.
ALPHA_TOPK = 64
# the lowest sampling temperature above 0 (greedy): logits / temperature overflow float32 near 1e-36 (then NaN
# log-probs, every row sampling token 0), and long before that the distribution is the greedy one
MIN_TEMPERATURE = 1e-6


# ----------------------------------------------------------------------------- input checks

def check_shapes(**tensors):
    """Raise ValueError unless all given tensors have the shape of the first one."""
    (first, ref), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.shape != ref.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)} like {first}")


def check_groups(rewards, group_size):
    """Raise ValueError unless rewards [N] are finite and split into whole groups of `group_size` rows."""
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be a flat [N] tensor, got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of group_size={group_size}")
    if not torch.isfinite(rewards).all():     # one NaN reward would make its group's advantages, then the loss, NaN
        row = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"rewards must be finite, got {rewards[row].item()} at row {row}")


def check_band(low, high):
    """Raise ValueError unless [low, high] is a proper band of ratios."""
    if not 0 <= low < high:
        raise ValueError(f"need 0 <= low < high for the rho band, got low={low}, high={high}")


# ----------------------------------------------------------------------------- re-scoring (section 1)

def response_logprobs(model, rollouts, temperature=1.0, topk=False, chunk=None, **model_kwargs):
    """Log-probs of the response tokens under the full prefix, with grad (pi_theta).

    Each row is `prompt + response`, right-padded, with natural positions 0, 1, 2, ...;
    the logit at position j predicts the token at j + 1, so response token t of row i
    (prompt length P_i) is scored at position P_i - 1 + t. Right padding keeps every real
    token's computation identical to an unpadded pass: causal attention never looks ahead.

        logp[i, t] = log_softmax(lm_head(h[i, P_i - 1 + t]) / temperature)[tokens[i, t]]

    temperature 0 means the sampler was greedy: score at temperature 1, as it recorded.
    Returns logp [N, T] (0 where mask is 0); with topk=True also the log-probs at the
    sampler's `topk_ids`, [N, T, k] (meaningful where mask is 1). `model_kwargs` reach the
    model's attention function (distill.py's sparse forward passes its masks this way).

    Memory: the decoder's hidden states [N, L, H] are computed once; the output layer and the
    fp32 log-softmax then run `chunk` response positions at a time (default: as many as keep
    N * chunk * V under CHUNK_ELEMENTS), so the vocabulary-sized part of the peak is about
    2 * N * chunk * V * 4 bytes (logits and log-probs, fp32) instead of 2 * N * T * V * 4: with
    Qwen's V = 151936, 32 rows of 4096 tokens would need ~160 GB at once, ~1 GiB a chunk. With
    grad and more than one chunk, each chunk is recomputed in the backward pass (checkpointed), not kept.
    """
    tokens, mask, prompts = rollouts.tokens, rollouts.mask, rollouts.prompts
    check_shapes(tokens=tokens, mask=mask, logprobs=rollouts.logprobs)
    # NaN: NaN log-probs everywhere; inf: a uniform distribution; 1e-40: overflow
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < float("inf")):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}")
    if len(prompts) != tokens.shape[0] or min(map(len, prompts)) < 1:
        raise ValueError(f"need {tokens.shape[0]} non-empty prompts for {tokens.shape[0]} responses")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive integer (response positions at a time), got {chunk!r}")
    device = model.device
    N, T = tokens.shape
    lengths = torch.tensor([len(p) for p in prompts], device=device)    # P_i
    L = int(lengths.max()) + T
    ids = torch.zeros(N, L, dtype=torch.long, device=device)
    attention_mask = torch.zeros(N, L, dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        P = len(prompt)
        ids[i, :P] = torch.tensor(prompt, device=device)
        ids[i, P:P + T] = tokens[i]
        attention_mask[i, :P] = 1
        attention_mask[i, P:P + T] = (mask[i] > 0).long()
    positions = torch.arange(L, device=device).expand(N, L)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attention_mask, position_ids=positions,
                                 use_cache=False, **model_kwargs).last_hidden_state            # [N, L, H]
    at = (lengths - 1)[:, None] + torch.arange(T, device=device)        # [N, T] the positions P_i - 1 + t
    h = hidden[torch.arange(N, device=device)[:, None], at]                                 # [N, T, H]
    head, tokens = model.get_output_embeddings(), tokens.to(device)
    ids_k = rollouts.topk_ids.to(device) if topk else tokens[..., None]                     # [N, T, k]

    def score(h, tokens, ids_k):       # one chunk of positions: [N, c, H] -> [N, c], [N, c, k]
        logp_all = torch.log_softmax(head(h).float() / (temperature or 1.0), dim=-1)       # [N, c, V]
        return logp_all.gather(-1, tokens[..., None]).squeeze(-1), logp_all.gather(-1, ids_k)

    chunk = chunk or max(1, CHUNK_ELEMENTS // (N * model.config.vocab_size))
    checkpointed = torch.is_grad_enabled() and h.requires_grad and T > chunk   # one chunk: nothing to save
    parts = [torch.utils.checkpoint.checkpoint(score, *args, use_reentrant=False) if checkpointed else score(*args)
             for args in zip(h.split(chunk, 1), tokens.split(chunk, 1), ids_k.split(chunk, 1))]
    logp = torch.cat([p[0] for p in parts], 1).masked_fill(mask.to(device) == 0, 0.0)
    if topk:
        return logp, torch.cat([p[1] for p in parts], 1)
    return logp


@torch.no_grad()
def dense_logprobs(model, rollouts, batch_size=8, temperature=1.0, topk=False, chunk=None):
    """pi_old: `response_logprobs` without grad, `batch_size` responses at a time (`chunk` positions at a time
    through the output layer: its docstring has the memory formula).

    Returns logp_old [N, T]; with topk=True also the dense log-probs at the sampler's
    top-k ids [N, T, k], for the acceptance measure (section 4).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    N = len(rollouts)
    parts = [response_logprobs(model, rollouts.select(list(range(start, min(start + batch_size, N)))),
                               temperature, topk, chunk) for start in range(0, N, batch_size)]
    if topk:
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.cat(parts)


# ----------------------------------------------------------------------------- measuring (section 4)

def ratio(log_rho):
    """rho = exp(clamp(log rho, -20, 20)), any shape; finite even for log rho = +-1000."""
    return log_rho.clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP).exp()


def acceptance(topk_logp_a, topk_logp_b):
    """Per-token acceptance alpha = sum_v min(p_a(v), p_b(v)) over the listed ids v.

    topk_logp_a, topk_logp_b: [..., k] log-probs of two distributions at the same k token ids
    (the sampler's top-k). Returns alpha [...]. Equal to 1 - TV(p_a, p_b) when the k ids cover
    the vocabulary, a lower bound on it otherwise (section 4).
    """
    check_shapes(topk_logp_a=topk_logp_a, topk_logp_b=topk_logp_b)
    return torch.minimum(topk_logp_a.exp(), topk_logp_b.exp()).sum(-1)


def mismatch_stats(logp_dense, logp_sparse, mask, topk_dense=None, topk_sparse=None, low=0.5, high=1.5):
    """How far the sampler strayed from the dense policy, over the response tokens.

    logp_dense, logp_sparse, mask: [N, T]; topk_dense, topk_sparse: [N, T, k] at the same ids.
    log rho = logp_dense - logp_sparse, rho = pi_old / pi_sparse. With tokens drawn from
    pi_sparse both k1 = -log rho and k3 = rho - 1 - log rho average to KL(pi_sparse || pi_old).
    Returns floats: tokens, rho_mean/min/max/p05/p50/p95, kl_k1, kl_k3, out_of_band (share of
    tokens with rho outside [low, high]) and, given top-k, alpha_mean and alpha_p05, pooled over every
    context: the paper's tail statistic (>= 0.86) is per length bin (schedule.tail_by_bin), and a late bin
    can fail beneath a pooled p05 that holds. With no tokens every value is 0.
    """
    check_shapes(logp_dense=logp_dense, logp_sparse=logp_sparse, mask=mask)
    check_band(low, high)
    if (topk_dense is None) != (topk_sparse is None):
        raise ValueError("give both topk_dense and topk_sparse, or neither")
    real = mask > 0
    log_rho = (logp_dense - logp_sparse)[real].double().clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP)
    rho = log_rho.exp()
    keys = ["rho_mean", "rho_min", "rho_max", "rho_p05", "rho_p50", "rho_p95", "kl_k1", "kl_k3", "out_of_band"]
    if topk_dense is not None:
        check_shapes(topk_dense=topk_dense, topk_sparse=topk_sparse)
        keys += ["alpha_mean", "alpha_p05"]
    stats = dict.fromkeys(keys, 0.0)
    stats["tokens"] = int(real.sum())
    if stats["tokens"] == 0:
        return stats
    # np.quantile interpolates as torch.quantile does, which refuses more than 2^24 values (16.8M tokens, e.g. 512
    # prompts x 8 x 4096; the official 128 x 8 x 4096 is 4.2M): a whole rollout lost to a RuntimeError in its stats
    q05, q50, q95 = np.quantile(rho.cpu().numpy(), [0.05, 0.5, 0.95]).tolist()
    stats.update(rho_mean=rho.mean().item(), rho_min=rho.min().item(), rho_max=rho.max().item(),
                 rho_p05=q05, rho_p50=q50, rho_p95=q95, kl_k1=(-log_rho).mean().item(),
                 kl_k3=(rho - 1 - log_rho).mean().item(),
                 out_of_band=((rho < low) | (rho > high)).double().mean().item())
    if topk_dense is not None:
        alpha = acceptance(topk_dense.double(), topk_sparse.double())[real]
        stats.update(alpha_mean=alpha.mean().item(), alpha_p05=float(np.quantile(alpha.cpu().numpy(), 0.05)))
    return stats


# ----------------------------------------------------------------------------- correcting (section 5)

def rejection_mask(log_rho, mask, veto=1e-4, low=0.5, high=1.5, mode="token"):
    """Sparsity-aware rejection sampling (Sparse-RL): which tokens stay in the loss.

    log_rho, mask: [N, T]; rho = exp(clamp(log_rho, -20, 20)). Only real tokens (mask 1) are
    tested, so padding never triggers a veto.
      sequence veto: a response with any rho_t < veto (1e-4) keeps no token; compression
                     derailed it (e.g. endless repetition);
      mode "token":  tokens with rho_t outside [low, high] ([0.5, 1.5]) leave the mask;
      mode "geometric": a response whose geometric-mean ratio exp(mean_t log rho_t) lies
                     outside [low, high] keeps no token (use a narrow band, e.g. [0.99, 1.01]).
    The group stays: advantages come from all rewards, before rejection.
    Returns (new mask [N, T], stats: Python ints): vetoed (responses), emptied (other responses the band or
    the geometric test left with no token), dropped_tokens (real tokens removed for any reason), kept_tokens.
    """
    check_shapes(log_rho=log_rho, mask=mask)
    check_band(low, high)
    if not veto >= 0:
        raise ValueError(f"veto must be >= 0 (0 disables it), got {veto}")
    if mode not in ("token", "geometric"):
        raise ValueError(f"mode must be 'token' or 'geometric', got {mode!r}")
    real = mask > 0
    rho = ratio(log_rho)
    vetoed = ((rho < veto) & real).any(-1)                                           # [N]
    if mode == "token":
        keep = real & (rho >= low) & (rho <= high)
    else:
        clamped = torch.where(real, log_rho.clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP), 0.0)
        geo = (clamped.sum(-1) / real.sum(-1).clamp(min=1)).exp()                  # [N]
        keep = real & ((geo >= low) & (geo <= high))[:, None]
    keep &= ~vetoed[:, None]
    emptied = real.any(-1) & ~keep.any(-1) & ~vetoed
    stats = dict(vetoed=int(vetoed.sum()), emptied=int(emptied.sum()),
                 dropped_tokens=int((real & ~keep).sum()), kept_tokens=int(keep.sum()))
    return keep.to(mask.dtype), stats


def importance_weights(log_rho, mask, cap=1.5, normalize=True, mode="truncate"):
    """Importance weights w_t for the dense objective from sparse samples; detached.

    log_rho, mask: [N, T], with `mask` the ORIGINAL response mask (before rejection).
      mode "truncate" (TIS):  w_t = min(rho_t, cap)        Sparse-RL cap 1.5; Sparrow uses 3
      mode "mask" (masked IS): w_t = rho_t if rho_t <= cap else 0   (drop instead of clip)
    normalize: divide by the mean of w over the batch's original response tokens, so the
    weights average 1 and only redistribute the gradient between tokens (section 5).
    Returns w [N, T], 0 where mask is 0.
    """
    check_shapes(log_rho=log_rho, mask=mask)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    rho = ratio(log_rho.detach())
    w = rho.clamp(max=cap) if mode == "truncate" else torch.where(rho <= cap, rho, 0.0)
    w = torch.where(mask > 0, w, 0.0)
    if normalize:
        mean = w.sum() / (mask > 0).sum().clamp(min=1)
        w = w / mean.clamp(min=torch.finfo(w.dtype).tiny)  # all-zero w (nothing kept) stays 0
    return w


# ----------------------------------------------------------------------------- learning (sections 5, 8)

def group_advantages(rewards, group_size, scale=True, eps=1e-4):
    """GRPO advantages, normalised within each group of `group_size` consecutive rollouts.

    rewards: [N], rows g*group_size .. (g+1)*group_size - 1 answer prompt g.
        A_i = (r_i - mean_g) / (std_g + eps)     scale=True (GRPO; PODS uses eps 1e-4)
        A_i =  r_i - mean_g                      scale=False (`--no-std`: Dr. GRPO's advantage)
    std is the sample std, Bessel-corrected (divides by n - 1), as PODS, TRL, verl and slime compute
    it: a group of two rewards {0, 1} gets A = +-0.707. A group whose rewards are all equal (a
    group of one too) carries no signal: its advantages are exactly 0, not NaN (section 8).
    Returns (advantages [N], float: integer rewards give float advantages; stats: groups, zero_std_groups).
    """
    check_groups(rewards, group_size)
    if scale and not eps > 0:
        raise ValueError(f"eps must be > 0 when scale=True, got {eps}")
    r = rewards.double().view(-1, group_size)                                         # [G, n]
    centered = r - r.mean(-1, keepdim=True)
    if scale:
        std = r.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])   # torch.std: n - 1
        centered = centered / (std + eps)
    flat = r.max(-1).values == r.min(-1).values                                       # [G]
    advantages = centered.masked_fill(flat[:, None], 0.0)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return advantages.view(-1).to(dtype), dict(groups=r.shape[0], zero_std_groups=int(flat.sum()))


def policy_loss(logp, logp_old, advantages, mask, weights=None, clip=0.2, clip_high=None,
                kl_coef=0.0, logp_ref=None, agg="seq-mean", response_mask=None):
    """The clipped GRPO objective, importance-weighted, as a loss to minimise.

    logp [N, T] (pi_theta, with grad), logp_old [N, T] (pi_old), advantages [N] or [N, T],
    mask [N, T] (after rejection), weights [N, T] (from `importance_weights`, detached),
    response_mask [N, T] (before rejection, so it holds every kept token: the denominators).
        r_t = pi_theta(y_t) / pi_old(y_t)
        L_t = w_t * max(-r_t * A, -clip(r_t, 1 - eps, 1 + eps_high) * A)  (+ kl_coef * k3_t)
        k3_t = pi_ref / pi_theta - 1 - log(pi_ref / pi_theta)   (KL to a reference; Sparse-RL 1e-4)
    eps = `clip` (0.2, section 5); eps_high = `clip_high`, default eps (DAPO's clip-higher if larger).
    Single-step on-policy GRPO has r_t == 1 on the first update (pi_theta is pi_old), so the clip
    is inactive there and the gradient is -w_t * A * grad log pi_theta; r_t moves away from 1 only
    on later updates of the same batch. rho (compression) and r (staleness) are separate ratios.
    Rejection removes tokens from the sum, never from the count: the denominators come from
    `response_mask`, the responses as sampled (before rejection; default `mask`), as slime divides
    today and PODS does (Sparse-RL's released code divided by the kept tokens: section 5). A vetoed
    response adds 0 and still counts, so vetoes do not enlarge the step of the responses that remain:
      agg "seq-mean" (GRPO, Sparse-RL): sum_i [sum_t kept_it * L_it / n_i] / N, with n_i the
        tokens of response i and N every response given;
      agg "token-mean" (DAPO): sum_it kept_it * L_it / sum_i n_i.
    Returns (loss scalar, stats): tokens (kept), responses (that kept any), signal_tokens (kept
    tokens with A != 0), clip_frac, ratio_mean, weight_mean, kl. No kept token: loss 0, gradient 0; no
    signal (A = 0 everywhere): the policy-gradient term is 0, but a KL term (kl_coef > 0) still adds
    its loss and gradient (distill.py's "kl" variant is exactly this case).
    """
    response_mask = mask if response_mask is None else response_mask
    check_shapes(logp=logp, logp_old=logp_old, mask=mask, response_mask=response_mask)
    weights = torch.ones_like(mask) if weights is None else weights
    check_shapes(logp=logp, weights=weights)
    if logp_ref is not None:
        check_shapes(logp=logp, logp_ref=logp_ref)
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, "
                         f"expected [N] = {tuple(logp.shape[:1])} or [N, T] = {tuple(logp.shape)}")
    if not (clip > 0 and (clip_high is None or clip_high > 0)):
        raise ValueError(f"clip and clip_high must be > 0, got clip={clip}, clip_high={clip_high}")
    if agg not in ("seq-mean", "token-mean"):
        raise ValueError(f"agg must be 'seq-mean' or 'token-mean', got {agg!r}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0 (0: no KL term), got {kl_coef}")
    if kl_coef and logp_ref is None:
        raise ValueError(f"kl_coef={kl_coef} needs logp_ref, the reference model's log-probs")
    kept = mask > 0
    extra = (kept & ~(response_mask > 0)).any(-1)       # swapped masks would divide by the kept tokens, silently
    if extra.any():
        raise ValueError(f"mask keeps tokens outside response_mask in row {int(extra.nonzero()[0])}: mask is the "
                         f"mask after rejection, response_mask the tokens as sampled, so it must hold all of them")
    A = advantages if advantages.ndim == 2 else advantages[:, None].expand_as(logp)
    # masked_fill (not multiply) before exp: padding may hold anything (even -inf) and its gradient
    # is cut; rho's clamp (LOG_RHO_CLAMP) also keeps a very stale r finite.
    log_r = (logp - logp_old.detach()).masked_fill(~kept, 0.0).clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP)
    r = log_r.exp()
    r_clipped = r.clamp(1 - clip, 1 + (clip if clip_high is None else clip_high))
    pg = torch.maximum(-r * A, -r_clipped * A)
    per_token = weights.detach() * pg
    kl = torch.zeros_like(pg)
    if logp_ref is not None:
        log_ref = (logp_ref.detach() - logp).masked_fill(~kept, 0.0).clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP)
        kl = log_ref.exp() - 1 - log_ref
        # w_t corrects the policy-gradient estimate only; the KL is a separate regulariser
        per_token = per_token + kl_coef * kl
    per_token = per_token.masked_fill(~kept, 0.0)
    counts, sampled = kept.sum(-1), (response_mask > 0).sum(-1)                          # [N] each
    if agg == "seq-mean":
        loss = (per_token.sum(-1) / sampled.clamp(min=1)).sum() / max(len(sampled), 1)
    else:
        loss = per_token.sum() / sampled.sum().clamp(min=1)
    n = kept.sum().clamp(min=1)
    stats = dict(tokens=int(kept.sum()), responses=int((counts > 0).sum()),
                 signal_tokens=int((kept & (A != 0)).sum()),
                 clip_frac=((-r_clipped * A > -r * A) & kept).sum().item() / n.item(),
                 ratio_mean=(r.detach() * kept).sum().item() / n.item(),
                 weight_mean=(weights.detach() * kept).sum().item() / n.item(),
                 kl=(kl.detach() * kept).sum().item() / n.item())
    return loss, stats


# ----------------------------------------------------------------------------- saving work (section 7)

def downsample(rewards, group_size, m, rule="max-variance", generator=None):
    """PODS: keep m of the n = group_size rollouts of each prompt; returns kept row indices [G * m].

    rewards: [N] in consecutive groups. Rules:
      "max-variance": the m rewards of largest variance. The best subset is always the k highest
                      plus the m - k lowest for some k (section 7): sort once, then score every k
                      with prefix sums S1, S2 of r and r^2 in O(m), so O(n log n) per group:
                      var_k = S2_k / m - (S1_k / m)^2, each group's r centred first (rewards of 1e8
                      would lose the variance to S2's rounding)
      "max-reward":   the m highest rewards (worst in PODS);  "random": m uniformly (`generator`).
    Indices are sorted within each group; compute advantages over the kept subset afterwards:
    `group_advantages(rewards[idx], m)`.
    """
    check_groups(rewards, group_size)
    n = group_size
    if not isinstance(m, int) or not 1 <= m <= n:
        raise ValueError(f"m must be an integer in [1, group_size={n}], got {m!r}")
    if rule not in ("max-variance", "max-reward", "random"):
        raise ValueError(f"rule must be 'max-variance', 'max-reward' or 'random', got {rule!r}")
    r = rewards.double().view(-1, n)                                                  # [G, n]
    if rule == "random":
        chosen = torch.rand(r.shape, generator=generator, device=r.device).argsort(-1)[:, :m]
    elif rule == "max-reward":
        chosen = r.argsort(dim=-1, descending=True, stable=True)[:, :m]
    else:
        sorted_r, order = r.sort(dim=-1, stable=True)                       # ascending
        sorted_r = sorted_r - sorted_r.mean(-1, keepdim=True)   # variance ignores a shift; r^2 sums keep precision
        zero = r.new_zeros(r.shape[0], 1)
        S1 = torch.cat([zero, sorted_r.cumsum(-1)], -1)                       # [G, n + 1]
        S2 = torch.cat([zero, (sorted_r ** 2).cumsum(-1)], -1)
        k = torch.arange(m + 1, device=r.device)                             # k highest + (m - k) lowest
        sum1 = S1[:, m - k] + S1[:, n:] - S1[:, n - k]                        # [G, m + 1]
        sum2 = S2[:, m - k] + S2[:, n:] - S2[:, n - k]
        best = (sum2 / m - (sum1 / m) ** 2).argmax(-1, keepdim=True)         # [G, 1]
        j = torch.arange(n, device=r.device)
        in_subset = (j < m - best) | (j >= n - best)                          # [G, n], m per row
        chosen = order[in_subset].view(-1, m)
    offsets = torch.arange(r.shape[0], device=r.device)[:, None] * n
    return (chosen.sort(-1).values + offsets).view(-1)
