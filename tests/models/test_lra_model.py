"""The LRA encoder: padding invariance with every Table D attention, dual-encoder pair order, one training step."""

from __future__ import annotations

import pytest
import torch

from mita.models.lra import LRAEncoder

ATTENTIONS = {
    "full": {},
    "mita": {"m": 4, "k": 6},
    "mita_routing": {"m": 4, "k": 12},
    "agent_minus": {"agent_num": 4},
    "moba": {"block_size": 8, "topk_blocks": 2},
    "topk": {"k": 8},
}


def _batch(lengths: list[int], n: int, vocab: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (len(lengths), n), generator=g)
    mask = torch.arange(n)[None] >= torch.tensor(lengths)[:, None]
    return tokens.masked_fill(mask, 0), mask


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_padding_invariance(name: str) -> None:
    """More padding gives the same logits, and a sequence alone gives what it gives inside a padded batch."""
    torch.manual_seed(0)
    model = LRAEncoder(16, 96, 10, attention=name, attention_kwargs=ATTENTIONS[name]).eval()
    tokens, mask = _batch([40, 23, 31], 40)
    more_tokens = torch.cat([tokens, torch.zeros(3, 56, dtype=torch.long)], dim=1)
    more_mask = torch.cat([mask, torch.ones(3, 56, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        a = model(tokens, mask)
        b = model(more_tokens, more_mask)
        alone = model(tokens[1:2, :23], mask[1:2, :23])
        # Changing what sits in the padded positions changes nothing either.
        noisy = model(more_tokens.masked_fill(more_mask, 5), more_mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1:2], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, noisy, atol=1e-5, rtol=1e-5)
    # The test can fail: without the mask the padded batch gives other logits.
    assert not torch.allclose(model(more_tokens, None), a, atol=1e-3)


def test_mita_layers_are_1d_over_valid_tokens() -> None:
    model = LRAEncoder(16, 64, 2, attention="mita", attention_kwargs={"m": 4, "k": 4})
    for block in model.blocks:
        assert block.attn.landmark_layout == "1d"
        assert block.attn.grid_size is None and block.attn.num_prefix_tokens == 0


def test_dual_encoder_respects_pair_order() -> None:
    torch.manual_seed(0)
    model = LRAEncoder(16, 64, 2, attention="mita", attention_kwargs={"m": 4, "k": 4}, dual=True).eval()
    t1, m1 = _batch([30, 20], 32, seed=1)
    t2, m2 = _batch([12, 32], 32, seed=2)
    with torch.no_grad():
        ab = model(t1, m1, t2, m2)
        ba = model(t2, m2, t1, m1)
        x1, x2 = model.encode(t1, m1), model.encode(t2, m2)
        manual = model.head(torch.cat([x1, x2, x1 * x2, x1 - x2], dim=-1))
    torch.testing.assert_close(ab, manual)
    # x1 - x2 makes the head order-sensitive: swapping the documents changes the logits.
    assert not torch.allclose(ab, ba, atol=1e-4)
    with pytest.raises(ValueError, match="x2"):
        model(t1, m1)


def test_framework_module_takes_lra_batches() -> None:
    """The framework's ClassificationModule trains the dual encoder on the LRA batch dicts."""
    from tasks.common.module import ClassificationModule

    torch.manual_seed(0)
    net = LRAEncoder(16, 16, 2, attention="full", dual=True)
    module = ClassificationModule(net, num_classes=2, optimizer={"name": "adamw", "lr": 3e-3}, top_k=(1,))
    module.log = lambda *a, **k: None
    t1, m1 = _batch([16, 10, 12, 5], 16, seed=1)
    t2, m2 = _batch([9, 16, 4, 13], 16, seed=2)
    batch = {"x": t1, "key_padding_mask": m1, "x2": t2, "key_padding_mask2": m2, "label": torch.tensor([0, 1, 1, 0])}
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = module.training_step(batch, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_attention_config_mapping_gets_1d_layout() -> None:
    """The attention group's mapping (2D layout by default) builds 1D MiTA layers in the sequence encoder."""
    spec = {"name": "mita", "m": 4, "k": 4, "landmark_layout": "official", "routing_only": True}
    model = LRAEncoder(16, 64, 2, attention=spec)
    attn = model.blocks[0].attn
    assert attn.landmark_layout == "1d" and attn.routing_only and attn.k == 4
    tokens, mask = _batch([20, 9], 24)
    assert model(tokens, mask).shape == (2, 2)
