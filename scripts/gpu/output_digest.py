"""Digests of `mita.mita_attention` outputs and gradients on fixed inputs, to show a refactor changed no bit.

Runs the public API only (so the same script runs on the trees before and after a change), on the GPU shapes that
the kernels take different paths for, in bf16 / fp16 / fp32. Each case runs twice in the process: a case whose two
runs agree bit for bit is deterministic and its SHA-256 must match across trees; otherwise (atomics in a backward)
the float64 sums printed beside it are the comparison.

    python scripts/gpu/output_digest.py > after.jsonl
    python scripts/gpu/output_digest.py --compare before.jsonl after.jsonl   # one line per case, exit 1 on a change
    python scripts/gpu/output_digest.py --from 8 > rest.jsonl   # cases x dtypes from the 9th on (a split run)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mita  # noqa: E402
from mita.ops.landmarks import pool_landmarks  # noqa: E402

# (B, H, N, d, m, k, layout): DeiT-S, odd short rows, medium, long.
CASES = [
    (8, 6, 197, 64, 25, 25, "official"),
    (4, 2, 1025, 64, 49, 49, "1d"),
    (2, 2, 4097, 128, 32, 40, "1d"),
    (1, 2, 16384, 64, 64, 64, "1d"),
    (1, 2, 65536, 64, 128, 128, "1d"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def run(case, dtype):
    B, H, N, d, m, k, layout = case
    g = torch.Generator(device="cuda").manual_seed(N * 131 + d)
    q, kk, v = (torch.randn(B, H, N, d, device="cuda", generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, d, device="cuda", generator=g, dtype=dtype)
    if layout == "official":
        r = pool_landmarks(q, m, layout="official", grid=(14, 14), num_prefix_tokens=1)
    else:
        r = pool_landmarks(q, m, layout="1d")
    out = mita.mita_attention(q, kk, v, r, k)
    out.backward(do)
    return [out.detach(), q.grad, kk.grad, v.grad]


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def compare(before: str, after: str) -> bool:
    """Print per case whether the two digests agree (bit for bit where both runs were deterministic, else the
    float64 sums to 1e-6 relative); True when every case agrees."""
    rows = [{(str(r["case"]), r["dtype"]): r for r in map(json.loads, open(p))} for p in (before, after)]
    same = True
    for key in rows[0]:
        a, b = rows[0][key], rows[1].get(key)
        if b is None:
            ok, how = False, "missing after"
        elif a["deterministic"] and b["deterministic"]:
            ok, how = a["sha"] == b["sha"], "bit for bit"
        else:
            pairs = zip(a["sums_out_dq_dk_dv"], b["sums_out_dq_dk_dv"])
            ok = all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for x, y in pairs)
            how = "sums (a run was not deterministic)"
        same &= ok
        print(f"{key[0]} {key[1]}: {'same' if ok else 'DIFFERENT'} ({how})")
    return same


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    start = int(sys.argv[2]) if len(sys.argv) == 3 and sys.argv[1] == "--from" else 0
    for i, (case, dtype) in enumerate((c, t) for c in CASES for t in DTYPES):
        if i < start:
            continue
        first, second = run(case, dtype), run(case, dtype)
        d1, d2 = digest(first), digest(second)
        sums = [round(t.double().sum().item(), 6) for t in first]
        print(
            json.dumps(
                {
                    "case": case,
                    "dtype": str(dtype).split(".")[-1],
                    "sha": d1,
                    "deterministic": d1 == d2,
                    "sums_out_dq_dk_dv": sums,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
