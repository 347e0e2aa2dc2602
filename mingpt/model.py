"""The GPT language model: a decoder-only Transformer with a key/value cache for generation.

Pre-norm blocks and causal self-attention through `F.scaled_dot_product_attention`, in either architecture of
mingpt.shape.ARCHS (GPT-2's, or a modern one) or any mix of their parts."""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.nn import functional as F

from mingpt.errors import ConfigError
from mingpt.shape import PRESETS, GPTConfig  # noqa: F401  (the model's shape, importable from here too)


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer, preallocated: appending is a copy."""

    def __init__(self, shape: tuple[int, int, int, int], like: torch.Tensor):  # (batch, n_head, block_size, head_dim)
        self.k, self.v, self.length = like.new_empty(shape), like.new_empty(shape), 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new positions; return the keys and values of all positions so far."""
        end = self.length + k.size(2)
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def norm(config: GPTConfig, width: int) -> nn.Module:
    return RMSNorm(width) if config.norm == "rmsnorm" else nn.LayerNorm(width, bias=config.bias)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (its weight and eps, as snapshots hold them), times another `weight` (x's last dims) where given."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        normalise = _RMSNorm.apply if x.device.type == "cpu" else lambda x, eps: F.rms_norm(x, x.shape[-1:], eps=eps)
        return (normalise(x, self.eps) * (self.weight if weight is None else weight)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """x / sqrt(mean(x**2) + eps) over the last dimension, in fp32 at least (as torch's), with a backward of its own:
    autograd's through F.rms_norm, via pow, mean and rsqrt, takes several times as long on CPUs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float | None) -> torch.Tensor:
        x = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        r = x.square().mean(-1, keepdim=True).add_(torch.finfo(x.dtype).eps if eps is None else eps).rsqrt_()
        ctx.save_for_backward(y := x * r, r)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        y, r = ctx.saved_tensors  # the gradient less its part along y, which scaling by r removes
        return torch.addcmul(grad, y, (grad * y).mean(-1, keepdim=True), value=-1).mul_(r), None


def rotary(head_dim: int, start: int, length: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rotary positions start .. start+length-1, as a function that turns x (B, T, ..., head_dim) by them: each pair of
    dimensions (i, i + head_dim/2) by an angle that grows with the position, at a frequency of its own."""
    half = head_dim // 2
    frequencies = 10000.0 ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.arange(start, start + length, device=device, dtype=torch.float32)[:, None, None, None] * frequencies
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    return lambda x: torch.addcmul(x * cos.type_as(x), x.roll(half, -1), sin.type_as(x))  # (x1 c - x2 s, x2 c + x1 s)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        head = config.n_embd // config.n_head
        self.q_norm, self.k_norm = (RMSNorm(head), RMSNorm(head)) if config.qk_norm else (None, None)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, rope: Callable | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # queries and keys (normalised and turned together) and values; a split's backward is one concat
        qk, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).split([2, 1], dim=2)
        if self.q_norm is not None:  # q's and k's weights, each once per head: the shape of qk's last dimensions
            weight = torch.stack([self.q_norm.weight, self.k_norm.weight])[:, None].repeat(1, self.n_head, 1)
            qk = self.q_norm(qk, weight)
        if rope is not None:
            qk = rope(qk)
        (q, k), v = qk.permute(2, 0, 3, 1, 4).unbind(0), v.squeeze(2).transpose(1, 2)  # (B, n_head, T, head_dim) views
        if cache is not None:
            assert cache.length == 0 or T == 1, "feed several positions only into an empty cache"
            k, v = cache.append(k, v)
        # Every cached position lies in a query's past: a causal mask is needed only where several positions arrive at
        # once (training, or the prompt), and generation feeds the prompt into an empty cache, so the two never mix.
        y = attention(q, k, v, is_causal=T > 1, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, dropout_p: float) -> torch.Tensor:
    """Scaled dot-product attention; on CPUs always computed in fp32: PyTorch's CPU flash-attention kernel is so slow in
    bf16 that it makes a bf16-autocast step slower than an fp32 one, and casting q, k, v up costs far less."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal, dropout_p=dropout_p)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, dropout_p=dropout_p)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout, self.relu2 = config.dropout, config.mlp == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        # GPT-2's tanh form of GELU; on CPU it is also several times faster than the exact erf form.
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        return F.dropout(self.c_proj(h), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, rope: Callable | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if config.rotary else nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = norm(config, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") and config.zero_init:  # each block starts as the identity
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):  # GPT-2: scaled by 1/sqrt(their number), so the variance of the
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))  # residual stream holds
        if config.zero_init and not config.tie_weights:  # the first predictions are uniform
            nn.init.zeros_(self.lm_head.weight)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the embeddings' lookup tables (a tied token embedding counts: a head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wpe.weight.numel() if self.wpe is not None else 0
            n -= 0 if self.config.tie_weights else self.wte.weight.numel()
        return n

    def _hidden(self, idx: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        T = idx.size(1)
        start = caches[0].length if caches else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + T, device=idx.device))
        x = F.dropout(x, self.config.dropout, self.training)
        rope = rotary(self.config.n_embd // self.config.n_head, start, T, idx.device) if self.config.rotary else None
        for i, block in enumerate(self.blocks):  # one rotary table for all layers
            x = block(x, caches[i] if caches else None, rope)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) for token ids `idx` (B, T); with `targets`, also the mean cross-entropy."""
        logits = self.lm_head(self._hidden(idx))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: weight decay on matrices (Linear, Embedding), none on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]  # tied weights appear once
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    @torch.inference_mode()
    def stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None,
               use_cache: bool = True) -> Iterator[torch.Tensor]:
        """Yield the next token ids (B,), one step at a time, continuing the prompts `idx` (B, T); `temperature=0` is
        greedy. The context is a window of at most `block_size` tokens; once full it slides forward by half a block, so
        the cache is refilled only once every `block_size // 2` tokens. `use_cache=False` runs the same windows without
        it (for tests and benchmarks) and yields the same tokens."""
        check_sampling(temperature, top_k, top_p)
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError("prompt must be a (batch, length) tensor with at least one token")
        was_training = self.training
        self.eval()
        try:
            block = self.config.block_size
            keep = max(1, block // 2)  # tokens kept when the window slides
            tokens, caches = idx[:, -block:], None  # caches: built on the first step and after each slide
            for _ in range(max_new_tokens):
                if tokens.size(1) > block:
                    tokens, caches = tokens[:, -keep:], None
                new = caches is None  # without the cache, or with one to fill: the whole window
                caches = self._new_caches(tokens) if use_cache and new else caches
                hidden = self._hidden(tokens if new else tokens[:, -1:], caches)
                logits = self.lm_head(hidden[:, -1, :]).float()
                next_ids = sample_next(logits, temperature, top_k, top_p, generator)
                tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
                yield next_ids
        finally:
            self.train(was_training)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """The prompts `idx` (B, T) followed by `max_new_tokens` generated ids; see `stream`."""
        new = list(self.stream(idx, max_new_tokens, **kwargs))
        return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx

    def _new_caches(self, tokens: torch.Tensor) -> list[KVCache]:
        c, like = self.config, self.wte.weight
        return [KVCache((tokens.size(0), c.n_head, c.block_size, c.n_embd // c.n_head), like) for _ in self.blocks]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Reject sampling settings that make no sense, before any work is done."""
    if not math.isfinite(temperature) or temperature < 0:  # nan and inf would pass a bare `< 0`
        raise ConfigError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be a positive integer or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1] or None, got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token id per row of `logits` (B, vocab)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the more likely ones already cover top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    # Inverse-CDF sampling, one uniform number per row: torch.multinomial's distribution, without its fixed cost.
    probs = logits.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(cdf.size(0), 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    # u may round up to the total; then take the last token that can be drawn, not a filtered one.
    last_possible = probs.size(-1) - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(picked, last_possible)
