"""Training step time of the Table A networks on one GPU (synthetic input, no data loading).

Gives the compute-bound part of the hardware/time estimates in the experiment files' headers: one optimiser
step of DeiT at batch 128 per GPU, bf16 autocast, AdamW; 300 epochs at global batch 1024 are 375,300 steps
per GPU on 8 GPUs. Data loading (JPEG decoding, RandAugment) is not included and often dominates.

    python -m tasks.imagenet.step_time [--batch 128] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import timm
import torch

import mita.models  # noqa: F401

ROWS = [
    ("small", {"name": "full"}),
    ("small", {"name": "mita"}),
    ("small", {"name": "mita", "dwc": True, "gate": True}),
    ("tiny", {"name": "mita"}),
]
STEPS_300_EPOCHS_8_GPUS = 300 * 1_281_167 // 1024


def step_time(size: str, attention: dict, batch: int, steps: int, warmup: int = 5) -> float:
    """Seconds per optimiser step (forward, backward, AdamW) on the current CUDA device."""
    model = timm.create_model(f"mita_deit_{size}_patch16_224", attention=attention, drop_path_rate=0.1).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("model,attention,ms_per_step,hours_300_epochs_8_gpus,peak_gib")
    for size, attention in ROWS:
        torch.cuda.reset_peak_memory_stats()
        dt = step_time(size, attention, args.batch, args.steps)
        peak = torch.cuda.max_memory_allocated() / 2**30
        name = "+".join([attention["name"]] + [k for k, v in attention.items() if v is True])
        print(f"deit_{size},{name},{dt * 1e3:.1f},{dt * STEPS_300_EPOCHS_8_GPUS / 3600:.1f},{peak:.1f}")


if __name__ == "__main__":
    main()
