"""ListOps end to end: generated files -> data module -> encoder -> loss can fit the labels; the ports' init.

Guards the chain that a majority-class plateau would hide: labels that do not line up with their inputs, a
tokeniser that loses structure, a wrong padding side or mask, or an encoder that cannot carry what the labels
depend on to the pooled features would all keep the training loss near the label entropy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from script_loader import load_prepare_script

from mita.models.lra import LRAEncoder
from tasks.lra.data import LISTOPS_SYMBOLS, ListOpsDataModule

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    return load_prepare_script("listops")


def _write_listops(root: Path, n: int, seed: int, max_length: int) -> None:
    gen = _generator()
    rows = gen.generate(3 * n, seed, min_length=8, max_length=max_length, workers=1, progress=False)
    for i, split in enumerate(("train", "val", "test")):
        gen.write_tsv(root / f"basic_{split}.tsv", rows[i * n : (i + 1) * n])


def test_loaded_tokens_evaluate_to_their_labels(tmp_path: Path) -> None:
    """Every loaded example, decoded back from its token ids, evaluates to the label stored beside it."""
    _write_listops(tmp_path, 64, seed=3, max_length=40)
    gen = _generator()
    dm = ListOpsDataModule(str(tmp_path), max_length=48, batch_size=16, seed=0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["x"].shape == (16, 48)
    for tokens, mask, label in zip(batch["x"], batch["key_padding_mask"], batch["label"]):
        n_valid = int((~mask).sum())
        assert not mask[:n_valid].any()  # right padding
        words = [LISTOPS_SYMBOLS[int(t) - 1] for t in tokens[:n_valid]]
        source = " ".join("]" if w == "X" else w for w in words)
        assert gen.evaluate(gen.parse(source)) == int(label)


def test_listops_pipeline_fits_generated_examples(tmp_path: Path) -> None:
    """The encoder fed by the data module overfits 32 generated examples (loss far below the label entropy)."""
    _write_listops(tmp_path, 32, seed=5, max_length=24)
    dm = ListOpsDataModule(str(tmp_path), max_length=32, batch_size=16, seed=0)
    dm.setup()
    torch.manual_seed(0)
    net = LRAEncoder(dm.vocab_size, 32, dm.num_classes, dropout=0.0)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.0)
    labels = np.asarray(dm.datasets["train"].labels)
    prior = np.bincount(labels, minlength=10) / len(labels)
    entropy = float(-(prior[prior > 0] * np.log(prior[prior > 0])).sum())
    step = 0
    while step < 60:
        for batch in dm.train_dataloader():
            loss = F.cross_entropy(net(batch["x"], batch["key_padding_mask"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    net.eval()
    with torch.no_grad():
        batches = list(dm._loader("train", shuffle=False))
        logits = torch.cat([net(b["x"], b["key_padding_mask"]) for b in batches])
        y = torch.cat([b["label"] for b in batches])
    final = F.cross_entropy(logits, y).item()
    acc = (logits.argmax(-1) == y).float().mean().item()
    assert final < 0.25 * entropy, (final, entropy)
    assert acc >= 0.9, acc


def test_default_init_is_the_ports() -> None:
    """Embeddings N(0, 0.02); Linear layers keep PyTorch's default (std 1/sqrt(3 fan_in)) unless asked."""
    torch.manual_seed(0)
    net = LRAEncoder(16, 2000, 10)
    assert abs(net.pos_embed.weight.std().item() - 0.02) < 0.002
    assert abs(net.embed.weight.std().item() - 0.02) < 0.006
    fc1 = net.blocks[0].mlp[0]
    assert isinstance(fc1, nn.Linear)
    expected = 1 / (3 * fc1.in_features) ** 0.5
    assert abs(fc1.weight.std().item() - expected) < 0.1 * expected
    assert fc1.bias.abs().max() > 0
    old = LRAEncoder(16, 2000, 10, init="trunc_normal")
    assert abs(old.blocks[0].mlp[0].weight.std().item() - 0.02) < 0.002
    assert old.blocks[0].mlp[0].bias.abs().max() == 0
