"""A mass target against one fixed density covering as much (issue 28).

``PYTHONPATH=src python benchmarks/cpu/probes/mass_target.py [MASS ...]`` (default 0.95)

:func:`ditops.bench.video_attention.scattered_attention` at Wan's 21 x 16 x 24 tokens
(12 heads of 128, bf16 inputs, exact masses in fp32), the first frame's 3 blocks forced,
video order: ``estimate_block_mask(mass=0.95)`` with the per-row (``sampled``) and per-head
(``sampled_head``) methods; the exact softmax mass each head's mask keeps (mean, worst
head) and the mask's density (mean, per head); then the smallest single density (keep
ratio, bisection to 1/512) at which the same method's mask keeps at least that mean mass.
"""

from __future__ import annotations

import os
import sys

import torch

from ditops.bench.masks_scattered import _exact_coverage, _fixed_density_for
from ditops.bench.video_attention import exact_block_mass, scattered_attention
from ditops.ops.estimate_block_mask import estimate_block_mask


def main() -> None:
    q, k, _ = scattered_attention(21, 16, 24, heads=12, dtype=torch.bfloat16)
    mass = exact_block_mass(q.float(), k.float())
    base = {"dense_blocks": 3}
    print(f"load {os.getloadavg()}")
    targets = [float(a) for a in sys.argv[1:]] or [0.95]
    for target, method in ((t, m) for t in targets for m in ("sampled", "sampled_head")):
        with torch.inference_mode():
            mask, _ = estimate_block_mask(q, k, mass=target, method=method, **base)
        cov = _exact_coverage(mass, mask)
        dens = mask.float().mean((0, 2, 3))

        def at(keep: float, method: str = method) -> torch.Tensor:
            with torch.inference_mode():
                return estimate_block_mask(q, k, keep_ratio=keep, method=method, **base)[0]

        fixed, fixed_cov = _fixed_density_for(float(cov.mean()), at, mass)
        print(
            f"{method}: mass={target} keeps {float(cov.mean()):.3f} of each head's mass on average "
            f"(worst head {float(cov.min()):.3f}) at mean density {float(dens.mean()):.3f} "
            f"(heads {min(dens.tolist()):.3f}..{max(dens.tolist()):.3f}); one fixed density "
            f"needs {fixed:.3f} to keep {fixed_cov:.3f}"
        )
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
