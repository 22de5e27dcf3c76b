"""Batched generation through the evictable KV cache (METHOD.md sections 1 and 2).

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
from dataclasses import dataclass, field

import torch


@dataclass
class Rollouts:
    """N sampled responses, right-padded to a common length T.

    prompts        list of N prompts, each a list of token ids (no padding)
    tokens         [N, T] long   response tokens; `pad_token_id` after the row ended
    mask           [N, T] float  1.0 for response tokens up to and including EOS, else 0.0
    logprobs       [N, T] float  sampler log-prob of each chosen token, under the
                                 temperature-scaled distribution, before top-p (0 where mask is 0)
    topk_logprobs  [N, T, k]     the sampler's k largest log-probs at each step (same distribution)
    topk_ids       [N, T, k]     their token ids
    stats          dict          peak_kv_tokens, peak_kv_bytes, dense_kv_bytes, tokens_per_s, ...
    """

    prompts: list
    tokens: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    topk_logprobs: torch.Tensor
    topk_ids: torch.Tensor
    stats: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.prompts)

    def select(self, index):
        """The rollouts at `index` (a list or 1-D tensor of row numbers), stats kept as they are."""
        index = torch.as_tensor(index, dtype=torch.long)
        rows = lambda t: t[index.to(t.device)]
        return Rollouts([self.prompts[i] for i in index.tolist()], rows(self.tokens), rows(self.mask),
                        rows(self.logprobs), rows(self.topk_logprobs), rows(self.topk_ids), dict(self.stats))
