"""Precision choice, model FLOPs and MFU, the peak FLOP/s behind it, and what the trainer reports."""

import json

import pytest
import torch

from launch import train_here
from mingpt.model import GPT, GPTConfig
from mingpt.training import performance, precision
from mingpt.training.performance import cpu_flags, flops_per_token, mfu, peak_flops, peak_memory_bytes
from mingpt.training.precision import choose_compile, choose_precision


def test_flops_per_token_of_gpt_nano_by_hand():
    config = GPTConfig.from_preset("gpt-nano", vocab_size=65, block_size=64)  # 3 layers, 48 wide, no biases
    d, layers, vocab, block = 48, 3, 65, 64
    per_layer = 3 * d * d + d * d + 4 * d * d + 4 * d * d + 2 * d  # qkv, projection, MLP in and out, 2 LayerNorms
    params = layers * per_layer + d + vocab * d  # final LayerNorm; the token embedding, tied to the output layer
    assert GPT(config).num_params() == params == 86_400
    assert flops_per_token(config, params) == 6 * params + 12 * layers * d * block == 628_992
    # 10,000 tokens/s of that model on a 100 GFLOP/s device use 6.3% of it (6.29%).
    assert mfu(628_992, 10_000, 100e9) == pytest.approx(0.0628992)


@pytest.mark.parametrize("requested", ["fp32", "bf16", "fp16"])
def test_a_configured_precision_is_taken_as_it_is(requested):
    assert choose_precision(requested, torch.device("cpu"), 768) == (requested, "as configured")


@pytest.mark.parametrize("flags, width, expected, reason", [
    ({"avx2", "amx_bf16", "avx512_bf16"}, 128, "bf16", "natively with amx_bf16 and avx512_bf16"),
    ({"avx2", "avx512_bf16"}, 768, "bf16", "natively with avx512_bf16"),
    ({"avx2", "avx512_bf16"}, 48, "fp32", "48 wide, under 128, trains faster in fp32"),
    ({"avx2"}, 768, "fp32", "neither amx_bf16 nor avx512_bf16"),
])
def test_auto_on_a_cpu_takes_bf16_where_it_is_native_and_pays(monkeypatch, flags, width, expected, reason):
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    chosen, why = choose_precision("auto", torch.device("cpu"), width)
    assert chosen == expected and reason in why


@pytest.mark.parametrize("bf16, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_a_gpu_takes_bf16_where_it_has_it(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA Tesla V100")
    precision, why = choose_precision("auto", torch.device("cuda", 0), 768)
    assert precision == expected and "V100" in why


@pytest.mark.parametrize("requested, device, expected", [
    (None, "cpu", False), (None, "cuda", True), (True, "cpu", True), (False, "cuda", False),
])
def test_compile_is_automatic_on_gpus_only_unless_configured(requested, device, expected):
    use, why = choose_compile(requested, torch.device(device))
    assert use is expected and why.startswith("auto" if requested is None else "as configured")


def test_known_gpus_take_their_data_sheet_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == (756e12, "NVIDIA H100 PCIe's data sheet, dense bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    assert peak_flops(torch.device("cuda", 0), torch.float16)[0] == 989e12


def test_the_cpu_peak_is_probed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first, source = peak_flops(torch.device("cpu"), torch.float32)
    assert first > 1e8 and source.endswith("measured now")
    monkeypatch.setattr(performance, "_probe", lambda *args: pytest.fail("probed again"))
    again, source = peak_flops(torch.device("cpu"), torch.float32)
    assert again == first and "cached in" in source
    (tmp_path / "mingpt" / "peak_flops.json").write_text("{damaged")
    monkeypatch.setattr(performance, "_probe", lambda *args: 123e9)
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == 123e9  # a damaged cache is measured anew
    # Probing again (as the trainer does when MFU reads above 100%) keeps the highest figure.
    monkeypatch.setattr(performance, "_probe", lambda *args: 100e9)
    assert peak_flops(torch.device("cpu"), torch.float32, measure=True)[0] == 123e9
    monkeypatch.setattr(performance, "_probe", lambda *args: 200e9)
    assert peak_flops(torch.device("cpu"), torch.float32, measure=True)[0] == 200e9
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == 200e9


def test_the_trainer_reports_mfu_and_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a machine that never probed
    log = train_here(tmp_path, "trainer.max_steps=10")
    assert "MFU is measured against" in log and "measured now" in log and "float32 (as configured)" in log
    records = [json.loads(line) for line in (tmp_path / "snap" / "metrics.jsonl").read_text().splitlines()]
    progress = [r for r in records if "train_loss" in r]
    assert progress and all(0 < r["mfu"] < 1 and r["peak_memory_mb"] > 10 for r in progress)
    assert "% MFU" not in log and "| MFU " in log


def test_peak_memory_of_this_process_is_its_resident_high_water_mark():
    assert peak_memory_bytes(torch.device("cpu")) > 50e6  # torch alone takes more


def losses(root) -> list[float]:
    """The train loss of each progress line of the run in root/snap."""
    records = [json.loads(line) for line in (root / "snap" / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if "train_loss" in r]


NATIVE_BF16 = {"amx_bf16", "avx512_bf16"} & cpu_flags()


@pytest.mark.slow
@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has neither amx_bf16 nor avx512_bf16: bf16 would be emulated, "
                                            "100x slower than fp32, and auto never picks it here")
def test_bf16_autocast_on_a_cpu_trains_as_well_as_fp32(tmp_path):
    steps = ["trainer.max_steps=80", "trainer.log_every=1"]
    log = train_here(tmp_path / "bf16", *steps, "trainer.precision=bf16")
    train_here(tmp_path / "fp32", *steps)
    bf16, fp32 = losses(tmp_path / "bf16"), losses(tmp_path / "fp32")
    assert "bfloat16 (as configured)" in log
    assert bf16[-1] < bf16[0] - 1.0  # it learns: from about ln(vocab) = 4.6 down towards the data's entropy
    assert bf16[-1] == pytest.approx(fp32[-1], abs=0.05)


def test_tokens_per_second_leave_out_evaluation_and_saving(monkeypatch):
    from mingpt.training import performance

    clock = [100.0]
    monkeypatch.setattr(performance.time, "perf_counter", lambda: clock[0])
    throughput = performance.Throughput(tokens_per_step=1000)
    clock[0] += 1.0  # a step of training
    throughput.step()
    with throughput.excluding():
        clock[0] += 9.0  # an evaluation
    assert throughput.read() == (1000.0, 1.0, 9.0)
