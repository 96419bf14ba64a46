"""The LRA encoder: padding invariance with every Table D attention, dual-encoder pair order, one training step."""

from __future__ import annotations

import pytest
import torch

from mita.models.lra import LRAEncoder, compact_padding

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


def _scattered(b: int, n: int, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens with padding anywhere (as black pixels are in Pathfinder), every row keeping some valid tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, n, generator=g) < p
    mask[:, 0] = False
    tokens = torch.randint(1, 16, (b, n), generator=g)
    return tokens.masked_fill(mask, 0), mask


def test_compact_padding_moves_valid_tokens_first_and_cuts() -> None:
    x = torch.tensor([[0, 3, 0, 4, 5, 0, 0, 0], [6, 0, 7, 0, 0, 0, 0, 0]])
    tokens, pos, mask = compact_padding(x, x == 0, 2)
    assert torch.equal(tokens, torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]]))
    # Valid tokens keep their order and their positions in x; the cut is the longest row (3) rounded up to 2.
    assert pos[0, :3].tolist() == [1, 3, 4] and pos[1, :2].tolist() == [0, 2]
    assert torch.equal(mask, torch.tensor([[False, False, False, True], [False, False, True, True]]))
    # Nothing left to mask: no mask; never longer than the input.
    full = torch.ones(2, 5, dtype=torch.long)
    tokens, pos, mask = compact_padding(full, full == 0, 4)
    assert mask is None and torch.equal(pos, torch.arange(5).expand(2, 5))


def test_compact_padding_with_known_lengths_reads_nothing_back(monkeypatch) -> None:
    """Given the rows' (shortest, longest) valid counts, the cut is the same and no tensor is read back to the host
    (each read is a GPU synchronisation in a training step); lengths that cannot be the mask's are refused."""
    tokens, mask = _scattered(4, 40, 0.6, seed=5)
    counts = (~mask).sum(1).tolist()
    expected = compact_padding(tokens, mask, 8)
    model = LRAEncoder(16, 40, 3, attention="full").eval()
    with torch.no_grad():
        features = model.encode(tokens, mask)

    def no_readback(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    for name in ("tolist", "item", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, no_readback)
    got = compact_padding(tokens, mask, 8, (min(counts), max(counts)))
    # A list works too: DataLoader's pin_memory turns tuples into lists in some torch releases.
    for a, b in zip(compact_padding(tokens, mask, 8, [min(counts), max(counts)]), got, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        known = model(tokens, mask, valid_lengths=(min(counts), max(counts)))
        with pytest.raises(AssertionError, match="read back"):
            model(tokens, mask)
    monkeypatch.undo()
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(known, model.head(features))
    # All rows full after the cut: no mask, as without the lengths.
    full = torch.ones(2, 6, dtype=torch.long)
    assert compact_padding(full, full == 0, 4, (6, 6))[2] is None
    for bad in ((5, 3), (-1, 3), (2, 41)):
        with pytest.raises(ValueError, match="valid_lengths"):
            compact_padding(tokens, mask, 8, bad)


def test_scattered_padding_full_attention_matches_masked_dense_encoder() -> None:
    """The compacted encoder computes what the ports' encoder computes on the whole sequence: attention over the
    unmasked tokens at their own positions, pooled over them."""
    torch.manual_seed(0)
    model = LRAEncoder(16, 96, 3, attention="full").eval()
    tokens, mask = _scattered(3, 96, 0.8, seed=3)
    with torch.no_grad():
        got = model.encode(tokens, mask)
        h = model.embed(tokens) + model.pos_embed(torch.arange(96))[None]
        for block in model.blocks:
            h = block(h, mask)
        h = model.norm(h)
        valid = (~mask).float()[..., None]
        want = (h * valid).sum(1) / valid.sum(1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_scattered_padding_and_cut_length(name: str) -> None:
    """With padding inside rows, the cut length (pad_multiple) and the padded positions' contents change nothing."""
    torch.manual_seed(0)
    model = LRAEncoder(16, 96, 10, attention=name, attention_kwargs=ATTENTIONS[name], pad_multiple=64).eval()
    tokens, mask = _scattered(3, 96, 0.6, seed=4)
    with torch.no_grad():
        a = model(tokens, mask)
        model.pad_multiple = 1
        b = model(tokens, mask)
        noisy = model(tokens.masked_fill(mask, 7), mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, noisy, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(tokens, None), a, atol=1e-3)


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


def test_training_step_logs_the_batch_accuracy() -> None:
    from tasks.common.module import ClassificationModule

    torch.manual_seed(0)
    net = LRAEncoder(16, 16, 2, attention="full")
    module = ClassificationModule(net, num_classes=2, optimizer={"name": "adamw", "lr": 3e-3}, top_k=(1,))
    logged = {}
    module.log = lambda name, value, **k: logged.__setitem__(name, value)
    tokens, mask = _batch([16, 10, 12, 5, 7, 16], 16, seed=3)
    label = torch.tensor([0, 1, 1, 0, 1, 1])
    module.eval()  # no dropout: the two forwards below see the same logits
    module.training_step({"x": tokens, "key_padding_mask": mask, "label": label}, 0)
    with torch.no_grad():
        expected = (net(tokens, mask).argmax(-1) == label).float().mean()
    assert isinstance(logged["train/acc1"], torch.Tensor) and logged["train/acc1"].item() == expected.item()


def test_attention_config_mapping_gets_1d_layout() -> None:
    """The attention group's mapping (2D layout by default) builds 1D MiTA layers in the sequence encoder."""
    spec = {"name": "mita", "m": 4, "k": 4, "landmark_layout": "official", "routing_only": True}
    model = LRAEncoder(16, 64, 2, attention=spec)
    attn = model.blocks[0].attn
    assert attn.landmark_layout == "1d" and attn.routing_only and attn.topk == 4
    tokens, mask = _batch([20, 9], 24)
    assert model(tokens, mask).shape == (2, 2)


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_all_padding_row_stays_finite(name: str) -> None:
    """A row with no valid token (an all-black image under the pixel rule) gives finite logits and leaves the other
    rows as they are alone."""
    torch.manual_seed(0)
    model = LRAEncoder(16, 96, 3, attention=name, attention_kwargs=ATTENTIONS[name]).eval()
    tokens, mask = _scattered(3, 96, 0.5, seed=5)
    mask[1] = True
    tokens = tokens.masked_fill(mask, 0)
    with torch.no_grad():
        out = model(tokens, mask)
        alone = model(tokens[2:], mask[2:])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[2:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["full", "mita"])
def test_padded_training_step_on_cuda_never_synchronises(attention) -> None:
    """With the collate's valid lengths, a padded batch's forward and backward (bf16 autocast, the Triton MiTA
    backend) make no host synchronisation, so the host can queue the next step while the GPU works; without them
    the cut reads the counts back (one synchronisation)."""
    torch.manual_seed(0)
    model = LRAEncoder(16, 256, 3, attention={"name": attention, **ATTENTIONS[attention]}).cuda().train()
    tokens, mask = _scattered(4, 256, 0.6, seed=2)
    counts = (~mask).sum(1).tolist()
    tokens, mask = tokens.cuda(), mask.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(tokens, mask, valid_lengths=(min(counts), max(counts))).float().sum().backward()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(tokens, mask, valid_lengths=(min(counts), max(counts))).float().sum()
            loss.backward()
            with pytest.raises(RuntimeError, match="synchroniz"):
                model(tokens, mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
