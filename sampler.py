"""Batched generation through the evictable KV cache (docs/method.md sections 1 and 2).

This is pi_sparse, the sampler of a sparse rollout: a plain PyTorch decode loop that
feeds a Hugging Face causal LM one token at a time through `kvcache.KVCache`, and
records the log-prob of every token it samples (the `logp_sparse` that the trainer's
correction compares with a dense re-scoring).

    from sampler import generate
    from kvcache import SparseConfig
    out = generate(model, [[1, 5, 7], [1, 9]], SparseConfig("snapkv", budget=64),
                   max_new_tokens=32, temperature=1.0, eos_token_id=2)
    out.tokens, out.mask, out.logprobs, out.stats["peak_kv_bytes"]
"""
import numbers
import operator
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from correction import ALPHA_TOPK, MIN_TEMPERATURE   # the top-k that alpha sums over, the same everywhere
from hook import sparse_attention
from kvcache import CACHE_ARG, KVCache, SparseConfig
from static import StaticCache, capture

# Whether every row has ended is asked every DONE_EVERY steps, not every step: on a GPU the answer is a
# sync that stalls the launch of the next step. At most DONE_EVERY - 1 steps of padding are decoded in vain.
DONE_EVERY = 16


@dataclass
class Rollouts:
    """N sampled responses, right-padded to a common length T.

    prompts        list of N prompts, each a list of token ids (no padding)
    tokens         [N, T] long   response tokens; `pad_token_id` after the row ended
    mask           [N, T] float  1.0 for response tokens up to and including EOS, else 0.0
    logprobs       [N, T] float  sampler log-prob of each chosen token, under the temperature-scaled
                                 distribution, before top-p: not renormalised over the nucleus (generate)
                                 (0 where mask is 0)
    topk_logprobs  [N, T, k]     the sampler's k largest log-probs at each step (same distribution; 0 where
                                 mask is 0)
    topk_ids       [N, T, k]     their token ids (`pad_token_id` where mask is 0)
    stats          dict          peak_kv_tokens, peak_kv_bytes, dense_kv_bytes, tokens_per_s, ...
    kept           list or None  with record=True, per layer [T, N, H_kv, S]: the positions each forward
                                 pass attended to (0: the prefill; t: the step that fed response token
                                 t - 1), -1 where nothing, int16 (int32 past 32767 positions); what a
                                 training forward needs to see what the sampler saw (distill.py)
    """

    prompts: list
    tokens: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    stats: dict = field(default_factory=dict)
    kept: list = None

    def __len__(self):
        return len(self.prompts)

    def select(self, index):
        """The rollouts at `index` (a list or 1-D tensor of row numbers), stats kept as they are."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:   # a mask [F, T, T], made long, would pick the rows [0, 1, 1]
            raise ValueError("select takes row numbers, not a mask: select(mask.nonzero()[:, 0])")
        N, integral = len(self), not (index.is_floating_point() or index.is_complex())   # .long() would cut 0.5 to 0
        if index.dim() != 1 or index.numel() and not (integral and -N <= index.min() <= index.max() < N):
            raise ValueError(f"select takes a list or 1-D tensor of row numbers in [-{N}, {N}), got {index!r:.80}")
        index = index.long()                # [] comes as an empty float tensor
        rows = lambda t: t[index.to(t.device)]
        kept = None if self.kept is None else [k[:, index.to(k.device)] for k in self.kept]
        return Rollouts([self.prompts[i] for i in index.tolist()], rows(self.tokens), rows(self.mask),
                        rows(self.logprobs), rows(self.topk_logprobs), rows(self.topk_ids), dict(self.stats), kept)


def clock(device):
    """Seconds on a wall clock once `device` has finished its queued work. CUDA runs kernels asynchronously:
    an unsynchronised clock times their launch, not the work. Every measured time in the project reads this
    clock: the benches', train.py's seconds per phase, report.py inference's."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def left_pad(prompts, pad_token_id, device):
    """Prompts (lists of ids) -> input_ids [N, P] left-padded, positions [N, P] (-1 on padding)."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_token_id, dtype=torch.long)
    positions = torch.full((len(prompts), P), -1, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        positions[row, P - len(prompt):] = torch.arange(len(prompt))
    return ids.to(device), positions.to(device)


def sample_token(logp, temperature, top_p, noise):
    """Choose one token per row from log-probs [N, V]: argmax when greedy, else nucleus sampling.

    noise [N, V]: Exp(1) draws (None when greedy). argmax(p / noise) is a sample from p: it is how
    torch.multinomial(p, 1, generator=g) samples (ATen's one-sample path), and returns the same token
    when `noise` is drawn from g as `torch.empty_like(p).exponential_(generator=g)` (tested). Written out
    so that the noise is an input: a captured decode step (static.py) cannot call a host generator.
    """
    if temperature == 0:
        return logp.argmax(-1)
    probs = logp.exp()
    if top_p < 1.0:  # keep the smallest set of most likely tokens whose mass reaches top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return (probs / noise).argmax(-1)


def choose(logits, temperature, top_p, noise, k):
    """From next-token logits [N, V] (float32) to what a step records: the token [N], its log-prob [N],
    and the k largest log-probs [N, k] with their ids [N, k], all under the temperature-scaled distribution."""
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    token = sample_token(logp, temperature, top_p, noise)
    top = logp.topk(k, dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1), top.values, top.indices


def end_ids(eos_token_id):
    """The ids that end a row: none, one id, or a list of them (Hugging Face's form, as in Qwen's and Llama 3's
    generation configs) -> a list."""
    return [] if eos_token_id is None else list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) \
        else [eos_token_id]


def integer(value):
    """`value` as a Python int if it is an integer: a Python or numpy one, or a 0-d integer tensor (an element of a
    tensor of ids); else None. A bool is none, though Python counts True as 1."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and (value.dim() or value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:   # a float (1.7 would be cut to 1), a string, a list: no token id
        return None


def check_args(model, prompts, max_new_tokens, temperature, top_p, logprobs_topk, eos_token_id=None, pad_token_id=0,
               seed=0, sparse=None, record=False, captured=False):
    """Reject bad input with a message naming the value, before any forward pass."""
    for name, flag in (("record", record), ("captured", captured)):   # the text "False" is true: a captured run
        if flag not in (True, False):
            raise ValueError(f"{name} must be True or False, got {flag!r:.40}")
    if sparse is not None and not isinstance(sparse, SparseConfig):   # was an AttributeError from the cache
        raise ValueError(f"sparse must be a SparseConfig (None: the full cache), got {sparse!r:.80}")
    # a torch.Generator takes any 64-bit seed; a float, None or bool was a RuntimeError from manual_seed
    if integer(seed) is None or not -2 ** 63 <= integer(seed) < 2 ** 64:   # (not `in range`: None would scan it)
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r:.40}")
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r:.80}")
    vocab = model.config.vocab_size
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):   # iterated, text was named by its first letter, bytes taken as ids
            raise ValueError(f"prompt {i} is text, {prompt!r:.40}: prompts are token ids (tokenize it first)")
        try:
            ids = [integer(t) for t in prompt]
        except TypeError:   # one prompt's ids, [1, 5, 7], given for [[1, 5, 7]]
            raise ValueError(f"prompt {i} is {prompt!r:.40}, no list of token ids (one prompt: [[1, 5, 7]])") from None
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if None in ids:
            bad = prompt[ids.index(None)]
            raise ValueError(f"prompt {i} holds {bad!r:.40}: token ids are integers (no bool, float or text)")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): min {min(ids)}, max {max(ids)}")
    count = lambda n: integer(n) is not None and integer(n) >= 1   # as the ids: numpy ints too, True no count of 1
    if not count(max_new_tokens):
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_length(max(map(len, prompts)), integer(max_new_tokens), model.config)
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)   # None: was a TypeError from `<=`
    # NaN, or a temperature so small that logits / temperature overflow: token 0 sampled, NaN log-probs
    if not (real(temperature) and (temperature == 0 or MIN_TEMPERATURE <= temperature < float("inf"))):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature!r}")
    if not (real(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")   # !r: tensor(0.5) is no 0.5
    if not count(logprobs_topk):
        raise ValueError(f"logprobs_topk must be a positive integer, got {logprobs_topk!r}")
    # an id outside the vocabulary: an EOS would never match (rows run on past their end), a padding id would fail
    # in the embedding, at the prefill or, with prompts of one length, mid-rollout when the first row ends
    token_id = lambda i: integer(i) in range(vocab)
    if not all(map(token_id, end_ids(eos_token_id))):
        raise ValueError(f"eos_token_id must be a token id in [0, {vocab}) or a list of them, got {eos_token_id!r}")
    if not token_id(pad_token_id):
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}), got {pad_token_id!r}")


def check_length(longest_prompt, max_new_tokens, config):
    """Reject a generation that would run past the model's positions (`max_position_embeddings`): the model
    never saw them, and a huge `max_new_tokens` would fail later in torch's allocator instead."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and longest_prompt >= positions:   # else "so at most -75": the prompts are too long
        raise ValueError(f"the longest prompt ({longest_prompt} tokens) leaves none of the model's {positions} "
                         "positions for a response: shorter prompts (a toy run: a smaller --digits MAX)")
    if positions is not None and longest_prompt + max_new_tokens > positions:
        raise ValueError(f"max_new_tokens (--max-new-tokens) {max_new_tokens}: the longest prompt ({longest_prompt} "
                         f"tokens) plus the response must fit the model's {positions} positions, "
                         f"so at most {positions - longest_prompt}")


def forward(model, ids, positions, cache):
    """One forward pass through the cache; -> next-token logits [N, V] (float32). The cache must have been
    told of the step (`cache.start_step(positions)`): that bookkeeping stays on the host, out of the step."""
    # `cache` (`past_key_values` before transformers 5.24) makes each attention layer store its keys and
    # values in the cache; `kv_cache` reaches our attention hook (transformers passes extra kwargs down to it).
    out = model(input_ids=ids, position_ids=positions.clamp(min=0), **{CACHE_ARG: cache},
                use_cache=True, kv_cache=cache, logits_to_keep=1)
    return out.logits[:, -1].float()


def decode(model, cache, token, positions, noise, temperature, top_p, k):
    """One decode step, every layer to the sampled token: token [N] and positions [N, 1] in, `choose`'s
    four tensors out. With a `static.StaticCache` its shapes are the same at every step (captured=True)."""
    return choose(forward(model, token[:, None], positions, cache), temperature, top_p, noise, k)


@torch.no_grad()   # not inference_mode: the rollouts it returns are trained on, and autograd must accept them
def generate(model, prompts, sparse=None, max_new_tokens=256, temperature=1.0, top_p=1.0,
             eos_token_id=None, pad_token_id=0, seed=0, logprobs_topk=ALPHA_TOPK, record=False, captured=False):
    """Sample a response for every prompt through a `KVCache` compressed as `sparse` says (None: dense).

    prompts: N lists of token ids (ints, numpy ints or 0-d tensors; any lengths). Left-padded prefill, one token a step
    for every row; a row is done after EOS (`eos_token_id`: an id, or a list of ids as Hugging Face takes),
    the loop stops soon after all rows are done.
    temperature 0 is greedy (log-probs are then recorded at temperature 1, top_p unused). top_p < 1 draws
    each token from the nucleus, but the log-probs recorded (`logprobs`, `topk_logprobs`) stay those of the whole
    temperature-scaled distribution, not renormalised over the nucleus: what a dense re-scoring at that temperature
    gives, not the probability the token was drawn with (train.py samples with top_p 1, where the two agree).
    Reproducible per `seed`. With `record=True`, `kept` holds what each step attended (the cache, its buffers and
    its own `history`, is freed on return: the rollouts live on through the training step).
    `captured=True` decodes through `static.StaticCache`, whose step keeps its shapes: replayed from a
    CUDA graph on a GPU, run as is elsewhere; the same tokens, log-probs within rounding (static.py).
    Returns `Rollouts` with T = the steps up to the last row's EOS (or max_new_tokens); the cache's
    stats count every step it ran.
    """
    check_args(model, prompts, max_new_tokens, temperature, top_p, logprobs_topk, eos_token_id, pad_token_id,
               seed, sparse, record=record, captured=captured)
    prompts = [list(map(integer, p)) for p in prompts]      # numpy or 0-d tensor ids: Python ints from here on
    pad_token_id, seed = integer(pad_token_id), integer(seed)
    max_new_tokens, logprobs_topk = integer(max_new_tokens), integer(logprobs_topk)
    sparse, device = sparse or SparseConfig(), model.device
    # [E] the ids that end a row (E = 0: no EOS), as Python ints: torch.tensor takes no list of 0-d numpy arrays
    ends = torch.tensor([integer(e) for e in end_ids(eos_token_id)], dtype=torch.long, device=device)
    ids, positions = left_pad(prompts, pad_token_id, device)
    N, k = len(prompts), min(logprobs_topk, model.config.vocab_size)
    cache = (StaticCache if captured else KVCache)(sparse, model.config.num_hidden_layers, max_new_tokens, seed, record)
    generator = torch.Generator(device).manual_seed(seed)
    tokens, logprobs, topk_logprobs, topk_ids, masks = [], [], [], [], []
    done = torch.zeros(N, dtype=torch.bool, device=device)
    next_pos = positions[:, -1:] + 1
    start = clock(device)
    with sparse_attention(model):
        cache.start_step(positions)
        logits = forward(model, ids, positions, cache)
        # Exp(1) noise per step, from the seeded generator (see sample_token); none when greedy
        draw = lambda: None if temperature == 0 else torch.empty_like(logits).exponential_(generator=generator)
        chosen = choose(logits, temperature, top_p, draw(), k)
        step = partial(decode, model, cache, temperature=temperature, top_p=top_p, k=k)
        static_step = capture(step, cache) if captured else None
        for t in range(max_new_tokens):
            token, logprob, top_logprobs, top_ids = chosen
            token = token.masked_fill(done, pad_token_id)
            live = (~done).float()
            tokens.append(token)
            masks.append(live)
            logprobs.append(logprob * live)
            # a row past its EOS decodes padding: nothing to keep (masked_fill, not `* live`: -inf * 0 is NaN)
            topk_logprobs.append(top_logprobs.masked_fill(done[:, None], 0.0))
            topk_ids.append(top_ids.masked_fill(done[:, None], pad_token_id))
            if len(ends):
                done |= (token[:, None] == ends).any(-1)     # not isin: past a few ids it sorts, a sync on a GPU
                if t % DONE_EVERY == DONE_EVERY - 1 and bool(done.all()):
                    break
            if t == max_new_tokens - 1:
                break
            cache.start_step(next_pos)          # host bookkeeping: which rows compress at this step
            chosen = (static_step if captured and cache.static else step)(token, next_pos, draw())
            next_pos = next_pos + 1
    seconds = clock(device) - start
    mask = torch.stack(masks, 1)
    T = int(mask.any(0).sum())              # the steps up to the last live token (rows end for good)
    new_tokens = int(mask.sum())
    stats = dict(new_tokens=new_tokens, seconds=seconds, tokens_per_s=new_tokens / seconds,
                 peak_kv_tokens=cache.peak_kv_tokens, dense_kv_tokens=cache.dense_kv_tokens,
                 peak_kv_bytes=cache.peak_kv_bytes, dense_kv_bytes=cache.dense_kv_bytes,
                 compressions=cache.compressions)
    kept = None
    if record:
        padded = lambda steps: [F.pad(s, (0, max(s.shape[-1] for s in steps) - s.shape[-1]), value=-1) for s in steps]
        kept = [torch.stack(padded(layer[:T])) for layer in cache.history]
    columns = lambda steps: torch.stack(steps[:T], 1)
    return Rollouts(prompts, columns(tokens), mask[:, :T], columns(logprobs),
                    columns(topk_logprobs), columns(topk_ids), stats, kept)
