import math

import pytest
import torch
import torch.nn.functional as F

from mingpt.errors import ConfigError
from mingpt.model import GPT, PRESETS, GPTConfig, attention, sample_next


def tiny(vocab=17, block=16, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=2, n_head=2, n_embd=32, **kw))


def test_presets_have_the_published_sizes():
    assert PRESETS["gpt-nano"] == (3, 3, 48)
    assert PRESETS["gpt-micro"] == (4, 4, 128)
    assert PRESETS["gpt-mini"] == (6, 6, 192)
    assert PRESETS["gpt2"] == (12, 12, 768)
    assert PRESETS["gpt2-xl"] == (48, 25, 1600)
    config = GPTConfig.from_preset("gpt-mini", vocab_size=65, block_size=128, dropout=0.1)
    assert (config.n_layer, config.n_head, config.n_embd, config.dropout) == (6, 6, 192, 0.1)


def test_gpt2_parameter_count_matches_the_published_124m():
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(GPTConfig.from_preset("gpt2", vocab_size=50257, block_size=1024, bias=True))
    assert model.num_params(non_embedding=False) == 124_439_808  # GPT-2 small, tied embeddings


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(n_embd=50, n_head=3), ["not divisible", "n_head"]),
        (dict(n_layer=0), ["n_layer", "positive"]),
        (dict(dropout=1.5), ["dropout"]),
    ],
)
def test_bad_shapes_are_refused_with_the_key_named(kwargs, words):
    with pytest.raises(ConfigError) as e:
        GPTConfig(vocab_size=10, block_size=8, **kwargs)
    assert all(w in str(e.value) for w in words)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown model preset 'gpt-huge'.*gpt-nano"):
        GPTConfig.from_preset("gpt-huge", 10, 8)


def test_attention_is_causal():
    model = tiny().eval()
    idx = torch.randint(0, 17, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 5) % 17
    logits, _ = model(idx)
    logits_changed, _ = model(changed)
    assert torch.equal(logits[:, :9], logits_changed[:, :9])
    assert not torch.allclose(logits[:, 9:], logits_changed[:, 9:])


def test_initial_loss_is_close_to_uniform_and_a_batch_can_be_overfit():
    vocab = 50
    model = tiny(vocab=vocab)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, vocab, (4, 16), generator=g)
    y = torch.randint(0, vocab, (4, 16), generator=g)
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(vocab)) < 0.1
    opt = torch.optim.AdamW(model.param_groups(0.0), lr=3e-3)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_weight_tying_and_scaled_residual_init():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight
    untied = GPT(GPTConfig(17, 16, 2, 2, 32, tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight and untied.lm_head.weight.shape == (17, 32)
    assert "lm_head.weight" in dict(untied.named_parameters())  # trained as a parameter of its own
    big = GPT(GPTConfig(17, 16, n_layer=8, n_head=2, n_embd=256))
    proj_std = big.blocks[0].attn.c_proj.weight.std().item()
    fc_std = big.blocks[0].mlp.c_fc.weight.std().item()
    assert abs(fc_std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / math.sqrt(16)) < 0.001


def test_param_groups_decay_matrices_only():
    model = tiny(bias=True)
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    # every trainable parameter exactly once; the tied embedding is not counted twice
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


@pytest.mark.parametrize("block", [16, 7])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=5), dict(top_p=0.8)])
def test_kv_cache_gives_exactly_the_tokens_of_uncached_generation(block, sampling):
    model = tiny(block=block)
    prompt = torch.randint(0, 17, (3, 5), generator=torch.Generator().manual_seed(3))
    runs = []
    for use_cache in (True, False):
        g = torch.Generator().manual_seed(42)
        # 40 new tokens: the window slides several times past the block size
        runs.append(model.generate(prompt, 40, generator=g, use_cache=use_cache, **sampling))
    assert runs[0].shape == (3, 45)
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0][:, :5], prompt)


def test_generation_is_reproducible_under_a_seed_and_varies_without():
    model = tiny()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 30, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 30, generator=torch.Generator().manual_seed(7))
    c = model.generate(prompt, 30, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_greedy_generation_matches_argmax_of_the_forward_pass():
    model = tiny().eval()
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 1, temperature=0)
    logits, _ = model(prompt)
    assert out[0, -1].item() == logits[0, -1].argmax().item()


def test_long_prompt_keeps_its_last_block():
    model = tiny(block=8)
    prompt = torch.randint(0, 17, (1, 30), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, 3, temperature=0)
    alone = model.generate(prompt[:, -8:], 3, temperature=0)
    assert torch.equal(out[:, -3:], alone[:, -3:])


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, top_k=2, generator=g).item() for _ in range(200)}
    assert picks == {0, 1}
    picks = {sample_next(logits, top_p=0.7, generator=g).item() for _ in range(200)}
    assert picks == {0, 1}  # 0.5 < 0.7, so the second token is needed, the third is not
    picks = {sample_next(logits, top_p=0.4, generator=g).item() for _ in range(50)}
    assert picks == {0}


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan"))])
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        next(tiny().stream(torch.zeros(1, 1, dtype=torch.long), 1, **kwargs))


def test_generate_restores_training_mode():
    model = tiny(dropout=0.1)
    model.train()
    model.generate(torch.zeros(1, 1, dtype=torch.long), 2)
    assert model.training


def test_dropout_acts_in_training_only():
    model = tiny(dropout=0.5)
    idx = torch.randint(0, 17, (2, 16), generator=torch.Generator().manual_seed(5))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_attention_on_a_cpu_computes_bf16_inputs_in_fp32():
    q, k, v = (torch.randn(2, 3, 16, 8).to(torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attention(q, k, v, is_causal=True, dropout_p=0.0)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected.to(torch.bfloat16))


# -- the architectures --------------------------------------------------------------------------------------------

def trained_like(model: GPT) -> GPT:
    """`model` with every weight moved off its initial value (a zero-initialised one predicts uniformly)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model


def test_the_modern_architecture_has_each_of_its_parts():
    from mingpt.model import rotary
    from mingpt.shape import ARCHS

    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, **ARCHS["modern"])
    assert config.arch == "modern" and GPTConfig(50, 16).arch == "gpt2"
    torch.manual_seed(0)
    model = GPT(config)
    assert model.wpe is None and "wpe.weight" not in model.state_dict()  # rotary positions: no table
    assert isinstance(model.ln_f, torch.nn.RMSNorm) and isinstance(model.blocks[0].attn.q_norm, torch.nn.RMSNorm)
    assert model.lm_head.weight is not model.wte.weight  # a head of its own
    assert all(not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any() for block in model.blocks)
    x = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    assert model(x, x)[1].item() == pytest.approx(math.log(50), abs=1e-6)  # zero head: uniform at first
    mlp = model.blocks[0].mlp
    h = torch.randn(3, 32)
    assert torch.allclose(mlp(h), mlp.c_proj(F.relu(mlp.c_fc(h)) ** 2))
    # Rotary: a query and a key moved by the same number of positions score alike (relative positions only).
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    turned = lambda x, i: rotary(16, i, 1, x.device)(x)
    score = lambda i, j: (turned(q, i) * turned(k, j)).sum()
    assert score(3, 1) == pytest.approx(score(9, 7).item(), rel=1e-5) and turned(q, 0).equal(q)


@pytest.mark.parametrize("part", [dict(rotary=True), dict(norm="rmsnorm"), dict(qk_norm=True), dict(mlp="relu2"),
                                  dict(zero_init=True, tie_weights=False)])
def test_each_part_works_on_its_own_causal_and_cached_alike(part):
    model = trained_like(tiny(**part)).eval()
    idx = torch.randint(0, 17, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 5) % 17
    assert torch.equal(model(idx)[0][:, :9], model(changed)[0][:, :9])  # causal
    prompt = idx[:, :5]
    cached, uncached = (model.generate(prompt, 30, temperature=0, use_cache=c) for c in (True, False))
    assert torch.equal(cached, uncached)  # the cache continues rotary positions past the prompt, and past a slide


def test_a_model_arch_sets_the_parts_and_each_part_may_be_set_on_its_own():
    from mingpt.training.config import ModelConfig

    modern = ModelConfig(name="gpt-nano", arch="modern").build(65, 32)
    assert modern.arch == "modern" and modern.rotary and modern.mlp == "relu2" and not modern.tie_weights
    ablated = ModelConfig(name="gpt-nano", arch="modern", qk_norm=False, tie_head=True).build(65, 32)
    assert ablated.arch == "custom" and not ablated.qk_norm and ablated.tie_weights and ablated.rotary
    # Unset, the preset's: GPT-2's for the published GPTs, whose weights load and export; modern for the small ones.
    assert [ModelConfig(name=name).build(65, 32).arch for name in ("gpt-nano", "gpt-mini", "openai-gpt", "gpt2-xl")] \
        == ["modern", "modern", "gpt2", "gpt2"]


@pytest.mark.parametrize("kwargs, words", [(dict(norm="batchnorm"), "model.norm must be one of layernorm, rmsnorm"),
                                           (dict(mlp="swiglu"), "model.mlp one of gelu, relu2"),
                                           (dict(n_head=3, n_embd=9, rotary=True), "model.rotary needs an even head")])
def test_unknown_parts_and_a_rotary_odd_head_are_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        GPTConfig(**{"vocab_size": 17, "block_size": 16, **kwargs})
