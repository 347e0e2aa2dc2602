"""The optimizer (`trainer.optimizer`): AdamW for every parameter, or Muon for the blocks' matrices (attention and
MLP weights) with AdamW for the rest (embeddings, the head, norms, biases), as the modded-nanogpt speedrun and
nanochat train. Muon orthogonalises each matrix's update as a whole, so it trains unsharded models only (ddp):
config.validate refuses it with fsdp and hsdp, and parallel.choose resolves auto to ddp for it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mingpt.model import GPT
from mingpt.training.config import TrainerConfig


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its settings, its state), orthogonalising in `dtype`, the model's compute dtype. torch's own
    always uses bf16: emulated and slow on a CPU without it, and its rounding makes runs that sum the same gradients in
    another order (at another world size) drift apart, where fp32 keeps them as close as AdamW does."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype, **settings):
        super().__init__(params, **settings)
        self.dtype = dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            wide = []  # the updates, a tall matrix's as its transpose
            for p in params:
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buffer.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                p.mul_(1 - group["lr"] * group["weight_decay"])
                wide.append(update.mT if update.size(0) > update.size(1) else update)
            for shape in dict.fromkeys(u.shape for u in wide):  # one batch a shape: fewer, larger matmuls
                batch = [i for i, u in enumerate(wide) if u.shape == shape]
                stacked = torch.stack([wide[i] for i in batch]).to(self.dtype)
                done = orthogonalise(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"])
                for p, x in zip([params[i] for i in batch], done):  # torch's "original" scale: it grows with the aspect
                    p.add_(x if x.shape == p.shape else x.mT, alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def orthogonalise(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz on wide matrices (n, rows <= cols): singular values moved towards 1."""
    a, b, c = coefficients
    x = g / g.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # singular values at most 1, where the iteration converges
    for _ in range(steps):  # x <- a x + (b G + c G G) x, where G = x x^T
        x = torch.baddbmm(x, torch.baddbmm(gram := x @ x.mT, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class MuonAdamW:
    """Muon and AdamW as one optimizer for the trainer and the loss scaler (`param_groups`, `step`, `zero_grad`).
    torch's state-dict API takes it as the list of the two (it iterates over them) and keys both states by
    parameter name in one dict, so snapshots, the memory tier and a live heal carry it as they carry AdamW alone."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter((self.adamw, self.muon))

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's groups, then Muon's. The groups themselves, not copies: setting a group's lr sets its optimizer's
        (loading a state replaces them, so they are looked up each time)."""
        return self.adamw.param_groups + self.muon.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def build_optimizer(model: GPT, t: TrainerConfig, dtype: torch.dtype) -> torch.optim.Optimizer | MuonAdamW:
    """`t.optimizer` over `model`'s parameters (placed already: sharding replaces them), computing in `dtype`."""
    betas = (t.beta1, t.beta2)
    if t.optimizer != "muon":
        return torch.optim.AdamW(model.param_groups(t.weight_decay), lr=t.lr, betas=betas,
                                 fused=True)  # one kernel for all parameters
    hidden = hidden_matrices(model)
    taken = {id(p) for p in hidden}
    rest = [{**group, "params": [p for p in group["params"] if id(p) not in taken]}
            for group in model.param_groups(t.weight_decay)]
    muon = Muon(hidden, dtype, lr=t.muon_lr, momentum=t.muon_momentum, weight_decay=t.muon_weight_decay)
    return MuonAdamW(muon, torch.optim.AdamW(rest, lr=t.lr, betas=betas, fused=True))


def hidden_matrices(model: GPT) -> list[torch.nn.Parameter]:
    """The blocks' 2-D weights: their attention and MLP matrices, which Muon optimises. The embeddings and the head
    map tokens, not hidden features, and norms and biases are vectors: AdamW's."""
    return [p for p in model.blocks.parameters() if p.dim() == 2 and p.requires_grad]


def is_muon(group: dict) -> bool:
    """Whether a parameter group is Muon's (only Muon's groups have Newton-Schulz steps)."""
    return "ns_steps" in group
