"""What each offload mode costs ditops in fusion and in time (Wan and FLUX, exact precision).

For every mode (none, model, sequential, group block-level, group leaf-level, each to
disk too) it builds the model twice with the same weights, applies the offload to both,
patches one (exact), checks the outputs are bitwise equal, and times both, interleaved,
in one process: the ratio is unpatched time / patched time under the same offload.
Fusion is what ``ditops.explain_patch`` says: blocks fused / blocks.

On a CPU-only machine the offloads move nothing between devices, so the times show the
hooks' and the fusion's cost, not transfer time.

    OMP_NUM_THREADS=2 python benchmarks/cpu/probes/offload.py [--reps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.integrations import test_offload as t

import ditops

WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16,
    out_channels=16, text_dim=64, freq_dim=64, ffn_dim=1024, num_layers=4,
    cross_attn_norm=True, rope_max_seq_len=1024,
)  # fmt: skip


def build_wan() -> tuple[torch.nn.Module, dict]:
    from diffusers import WanTransformer3DModel

    from ditops.bench.wan_model import cast_like_from_pretrained

    torch.manual_seed(0)
    model = cast_like_from_pretrained(WanTransformer3DModel(**WAN).eval(), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = {
        "hidden_states": torch.randn(1, 16, 5, 32, 32, generator=g).bfloat16(),  # 1280 tokens
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 32, 64, generator=g).bfloat16(),
    }
    return model, x


def build_flux() -> tuple[torch.nn.Module, dict]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    cfg = dict(t.flux_t.TINY, num_layers=2, num_single_layers=4, attention_head_dim=64,
               num_attention_heads=4, axes_dims_rope=(16, 24, 24))  # fmt: skip
    model = FluxTransformer2DModel(**cfg).bfloat16().eval()
    x = t.flux_t.inputs(side=32)
    return model, x


def timed(model: torch.nn.Module, x: dict) -> tuple[float, float]:
    """(wall, CPU) seconds of one forward: CPU time (all threads) is what a loaded shared
    machine distorts least."""
    wall, cpu = time.perf_counter(), time.process_time()
    t._run(model, x)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    modes = {"none": (lambda m, p: None, None), **t.MODES}
    rows = []
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    print(f"{'family':6} {'mode':17} {'fused':>7} {'unpatched s':>11} {'patched s':>10} "
          f"{'speedup':>8} {'CPU-time speedup':>17}")  # fmt: skip
    for family, build in (("wan", build_wan), ("flux", build_flux)):
        for mode, (apply, _) in modes.items():
            with tempfile.TemporaryDirectory() as tmp:
                plain, x = build()
                model, _ = build()
                apply(plain, Path(tmp) / "plain")
                apply(model, Path(tmp) / "patched")
                ditops.patch(model, precision="exact")
                same = torch.equal(t._run(plain, x)[0], t._run(model, x)[0])
                places = ditops.explain_patch(model)[type(model).__name__]
                blocks = [v for k, v in places.items() if "blocks." in k]
                fused = sum(v == "fused" for v in blocks)
                a, b = [], []
                for _ in range(args.reps):  # interleaved: load drifts hit both alike
                    a.append(timed(plain, x))
                    b.append(timed(model, x))
                ua, pb = (statistics.median(w for w, _ in r) for r in (a, b))
                uc, pc = (statistics.median(c for _, c in r) for r in (a, b))
                row = dict(family=family, mode=mode, fused=fused, blocks=len(blocks),
                           bitwise=same, unpatched_s=ua, patched_s=pb, speedup=ua / pb,
                           cpu_speedup=uc / pc, load=os.getloadavg()[0])  # fmt: skip
                rows.append(row)
                print(f"{family:6} {mode:17} {fused:>3}/{len(blocks):<3} {ua:11.3f} {pb:10.3f} "
                      f"{ua / pb:7.2f}x {uc / pc:16.2f}x{'' if same else '  NOT BITWISE'}",
                      flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
