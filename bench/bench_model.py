"""Model benchmark: training-step tokens/s, and generation tokens/s with and without the KV cache.

Sizes follow nanoGPT's CPU recipe (4 layers, 4 heads, 128 embd, vocab 65). Both generation
paths run in the same process, one after the other, so their ratio is the figure to read.

    python bench/bench_model.py [--threads 2] [--steps 50] [--new-tokens 500]
"""

from __future__ import annotations

import argparse
import time

import torch

from mingpt.model import GPT, GPTConfig


def train_tokens_per_second(steps: int, batch: int = 12, block: int = 64) -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=block, n_layer=4, n_head=4, n_embd=128))
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.99))
    x = torch.randint(0, 65, (batch, block))
    y = torch.randint(0, 65, (batch, block))

    def step():
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(5):  # warm-up: allocator, kernels
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * block / (time.perf_counter() - start)


def generation_tokens_per_second(use_cache: bool, new_tokens: int, preset: str, block: int = 256) -> float:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(preset, vocab_size=65, block_size=block))
    prompt = torch.zeros(1, 1, dtype=torch.long)
    model.generate(prompt, 10, use_cache=use_cache)  # warm-up
    start = time.perf_counter()
    model.generate(prompt, new_tokens, use_cache=use_cache, generator=torch.Generator().manual_seed(0))
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    tps = train_tokens_per_second(args.steps)
    print(f"train step (4L/4H/128E, block 64, batch 12, vocab 65): {tps:,.0f} tokens/s")
    for preset in ("gpt-micro", "gpt-mini"):  # gpt-micro is the recipe's 4 layers, 4 heads, 128 embd
        cached = generation_tokens_per_second(True, args.new_tokens, preset)
        uncached = generation_tokens_per_second(False, args.new_tokens, preset)
        print(f"{preset}: generate {args.new_tokens} tokens at block 256: KV cache {cached:,.0f} tokens/s, "
              f"no cache {uncached:,.0f} tokens/s, speed-up {cached / uncached:.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
