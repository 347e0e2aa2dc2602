"""trainer.optimizer=muon: Muon for the blocks' matrices, AdamW for the rest, one optimizer to the trainer. Its
state goes through the memory tier and a live heal as the trainer sends it, and the next steps are bitwise those
of the replica it came from. (Snapshots and the refusals: test_app; fsdp and auto: test_fsdp.)"""

import pytest
import torch

from mingpt.checkpoint.memory import MemoryTier
from mingpt.checkpoint.packing import assemble, placed_like
from mingpt.model import GPT, GPTConfig
from mingpt.shape import ARCHS
from mingpt.training.config import TrainerConfig
from mingpt.training.healing import decode, encode
from mingpt.training.optimizer import Muon, MuonAdamW, build_optimizer, is_muon, orthogonalise
from mingpt.training.schedule import lr_at, set_lr
from mingpt.training.state import Replica, TrainState, to_cpu

MUON = TrainerConfig(optimizer="muon", lr=3e-3, muon_lr=0.02, warmup_steps=2, max_steps=10)


def replica(t: TrainerConfig = MUON) -> Replica:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, **ARCHS["modern"]))
    return Replica(model, build_optimizer(model, t, torch.float32), None, TrainState())


def train(replica: Replica, steps: range, scaler: torch.amp.GradScaler | None = None) -> None:
    """Steps of the same batches, whoever takes them: batch i is drawn from seed i. With `scaler`, as the trainer
    steps under fp16."""
    for step in steps:
        set_lr(replica.optimizer, MUON, step)
        x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
        replica.optimizer.zero_grad(set_to_none=True)
        _, loss = replica.model(x[:, :-1], x[:, 1:])
        if scaler is None:
            loss.backward()
            replica.optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(replica.optimizer)  # to clip the true gradients
            scaler.step(replica.optimizer)
            scaler.update()
        replica.state.advance(4, f"{step}")


def assert_same(ours: Replica, theirs: Replica) -> None:
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
        assert torch.equal(p, q), name
    mine, other = ours.state_dict()["optimizer"], theirs.state_dict()["optimizer"]
    assert mine["state"].keys() == other["state"].keys()
    for name, state in mine["state"].items():
        for key, value in state.items():
            assert torch.equal(value, other["state"][name][key]), (name, key)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_on_one_schedule():
    ours = replica()
    optimizer = ours.optimizer
    assert isinstance(optimizer, MuonAdamW) and list(optimizer) == [optimizer.adamw, optimizer.muon]
    names = {id(p): name for name, p in ours.model.named_parameters()}
    muon = {names[id(p)] for group in optimizer.muon.param_groups for p in group["params"]}
    adamw = {names[id(p)] for group in optimizer.adamw.param_groups for p in group["params"]}
    assert muon == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                          "mlp.c_proj")}
    assert {"wte.weight", "lm_head.weight", "ln_f.weight", "blocks.0.attn.q_norm.weight"} <= adamw
    assert muon.isdisjoint(adamw) and muon | adamw == set(names.values())  # every parameter, once
    for step in (0, 5, 9):
        set_lr(optimizer, MUON, step)
        assert [group["lr"] for group in optimizer.param_groups if not is_muon(group)] == [lr_at(MUON, step)] * 2
        assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(lr_at(MUON, step) * 0.02 / 3e-3)
    assert optimizer.param_groups[0]["lr"] == lr_at(MUON, 9)  # the progress line shows AdamW's

    plain = replica(TrainerConfig(optimizer="adamw")).optimizer
    assert isinstance(plain, torch.optim.AdamW) and not any(map(is_muon, plain.param_groups))


def test_muons_state_goes_through_the_memory_tier_and_a_heal_and_the_steps_after_are_bitwise_the_same(tmp_path):
    source = replica()
    train(source, range(3))
    saved = source.state_dict()
    assert any("momentum_buffer" in state for state in saved["optimizer"]["state"].values())
    assert any("exp_avg" in state for state in saved["optimizer"]["state"].values())

    tier = MemoryTier("run", "job", root=str(tmp_path))  # as MemoryCopies copies and restores it
    tier.start()
    tier.save(saved, 3, source.state.saved())
    tier.wait()
    [held] = tier.shards()
    from_memory = replica()
    from_memory.load(assemble([MemoryTier.unpack(tier.read(held), held.header)]), True, held.header)
    tier.release()

    received = decode(encode({**to_cpu(saved), "train": source.state.saved()}))  # as a live peer sends it
    healed = replica()
    train_state = received.pop("train")
    healed.load(placed_like(received, healed.state_dict()), False, train_state)  # as Trainer._heal loads it

    for other in (from_memory, healed):
        assert other.state.step == 3 and other.optimizer.muon.state  # Muon's momentum came, not a fresh one
    for each in (source, from_memory, healed):
        train(each, range(3, 6))
    assert_same(from_memory, source)
    assert_same(healed, source)


def test_the_loss_scaler_unscales_and_steps_both_as_one_optimizer():
    """fp16's GradScaler (GPU only in the trainer; its CPU form here) takes MuonAdamW as an optimizer: a scale of a
    power of two is exact, so the scaled steps are bitwise the plain ones."""
    plain, scaled = replica(), replica()
    train(plain, range(3))
    train(scaled, range(3), torch.amp.GradScaler("cpu", init_scale=2.0**10))
    assert_same(scaled, plain)


def test_muon_steps_as_torchs_in_bf16_and_orthogonalises_in_fp32_where_the_model_computes_in_it():
    """Our Muon is torch.optim.Muon with the dtype of its Newton-Schulz steps chosen: in bf16 it steps bitwise as
    torch's does; in fp32 it moves the same weights the same way, without bf16's rounding."""
    torch.manual_seed(0)
    start = [torch.randn(24, 8), torch.randn(8, 24)]  # a tall matrix and a wide one
    grads = [torch.randn_like(w) for w in start]
    stepped = {}
    for name, make in [("torch", lambda ps: torch.optim.Muon(ps, lr=0.02)),
                       ("bf16", lambda ps: Muon(ps, torch.bfloat16, lr=0.02)),
                       ("fp32", lambda ps: Muon(ps, torch.float32, lr=0.02))]:
        params = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = make(params)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
        stepped[name] = [p.detach() for p in params]
        assert set(optimizer.state[params[0]]) == {"momentum_buffer"}  # torch's state, as snapshots hold it
    assert all(torch.equal(a, b) for a, b in zip(stepped["torch"], stepped["bf16"]))
    assert not any(torch.equal(a, b) for a, b in zip(stepped["bf16"], stepped["fp32"]))
    for a, b, w in zip(stepped["bf16"], stepped["fp32"], start):
        assert torch.allclose(a - w, b - w, atol=2e-3), (a - b).abs().max()  # bf16 rounds to about 1e-2 of a step
    x = orthogonalise(torch.randn(2, 16, 48), (3.4445, -4.775, 2.0315), 5, 1e-7)  # a batch of two
    assert torch.linalg.svdvals(x).min() > 0.5 and torch.linalg.svdvals(x).max() < 1.5  # near-orthogonal rows
