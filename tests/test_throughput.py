"""Throughput and MFU: the peak table, a CPU measurement, the command line, and (on a
GPU) a bf16 measurement whose MFU is a plausible fraction."""
import pytest
import torch

from distlab.bench import throughput
from distlab.model import GPT, config


@pytest.mark.parametrize("name,dtype,tflops", [
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "fp16", 756.0), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("AMD Instinct MI300X", "bf16", 1307.4)])
def test_peak_table(name, dtype, tflops):
    assert throughput.peak_flops(name, dtype) == tflops * 1e12


@pytest.mark.parametrize("name,dtype", [("NVIDIA H200", "fp32"), ("CPU", "bf16"),
                                        ("Some Future GPU", "bf16")])
def test_no_peak_no_mfu(name, dtype):
    assert throughput.peak_flops(name, dtype) is None


def test_measure_on_this_device():
    cfg = config("test", vocab_size=32)
    r = throughput.measure(cfg, batch_size=2, seq_len=8, dtype="fp32", steps=2, warmup=1)
    assert r.tokens_per_step == 16
    assert r.flops_per_token == GPT(cfg).flops_per_token(8)
    assert r.step_seconds > 0 and r.tokens_per_second == pytest.approx(16 / r.step_seconds)
    assert r.model_flops == pytest.approx(r.flops_per_token * r.tokens_per_second)
    if r.peak_flops is None:
        assert r.mfu is None and "n/a" in str(r)
    with pytest.raises(ValueError, match="dtype"):
        throughput.measure(cfg, 2, 8, dtype="int8")


def test_command_line_runs_through_data_parallel(capsys):
    assert throughput.main(["--model", "test", "--vocab-size", "32", "--batch-size", "2",
                            "--seq-len", "8", "--dtype", "fp32", "--steps", "1", "--warmup", "1",
                            "--world-size", "1", "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "rank 0:" in out and "tokens/s" in out


@pytest.mark.gpu
def test_bf16_mfu_on_a_gpu():
    cfg = config("small", vocab_size=8192)
    r = throughput.measure(cfg, batch_size=8, dtype="bf16", steps=5, warmup=3)
    assert r.device != "CPU"
    if r.mfu is not None:
        assert 0.01 < r.mfu < 1.0, str(r)
    assert torch.cuda.max_memory_allocated() > 0
