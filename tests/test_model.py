"""The GPT: shapes, causality, tying, parameter count and FLOPs per token."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distlab.model import GPT, PRESETS, GPTConfig, config


def test_logits_shape_and_causality():
    torch.manual_seed(0)
    model = GPT(config("test", vocab_size=11)).double()
    x = torch.randint(11, (3, 9))
    logits = model(x)
    assert logits.shape == (3, 9, 11)
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1) % 11            # change one token ...
    changed = model(y)
    torch.testing.assert_close(changed[:, :5], logits[:, :5])  # ... the past cannot see it
    assert not torch.allclose(changed[:, 5:], logits[:, 5:])


def test_weight_tying_shares_one_tensor_and_counts_it_once():
    tied = GPT(config("test", vocab_size=13))
    untied = GPT(config("test", vocab_size=13, tie_weights=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 13 * tied.cfg.d_model
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1


@pytest.mark.parametrize("tie", [True, False])
def test_num_params_matches_the_architecture(tie):
    cfg = config("tiny", vocab_size=37, tie_weights=tie)
    v, t, d, L = cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.n_layer
    # per block: qkv 3d^2+3d, proj d^2+d, up 4d^2+4d, down 4d^2+d, two LayerNorms 4d
    block = 12 * d * d + 13 * d
    embeddings = v * d + t * d
    expected = embeddings + L * block + 2 * d + (0 if tie else v * d)
    model = GPT(cfg)
    assert model.num_params() == expected
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    # the 6N count leaves out the tables that are only looked up
    assert model.num_params(matmul_only=True) == expected - t * d - (0 if tie else v * d)


@pytest.mark.parametrize("name", ["tiny", "gpt-100m"])
def test_flops_per_token_matches_counted_flops(name):
    """6N + 12 L d T against torch's FLOP counter on a forward + backward pass (on the
    meta device: shapes only, no arithmetic). The formula also counts the biases and
    LayerNorm weights, which the counter (matmuls only) leaves out."""
    cfg = config(name, vocab_size=512)
    batch, t = 2, cfg.seq_len
    with torch.device("meta"):
        model = GPT(cfg)
        x = torch.randint(cfg.vocab_size, (batch, t))
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    counted = counter.get_total_flops()
    rule = model.flops_per_token(t) * batch * t
    assert abs(rule - counted) / counted < 2.0 / cfg.d_model  # biases, LayerNorms ~ 1/d


def test_presets_and_bad_configs():
    assert set(PRESETS) >= {"test", "gpt-100m"}
    n = GPT(config("gpt-100m", vocab_size=16384)).num_params()
    assert 80e6 < n < 120e6, f"gpt-100m has {n / 1e6:.1f}M parameters"
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=8, seq_len=8, n_layer=1, n_head=3, d_model=16)
    with pytest.raises(ValueError, match="unknown model size"):
        config("huge", vocab_size=8)
    model = GPT(config("test", vocab_size=8))
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        model(torch.zeros(1, model.cfg.seq_len + 1, dtype=torch.long))
