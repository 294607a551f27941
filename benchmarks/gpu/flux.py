"""GPU check of the FLUX patch: parity through the Triton paths, then the model bench.

    python3 benchmarks/gpu/flux.py $OUT      (writes $OUT/flux_gpu.json)

1. a tiny FluxTransformer2DModel (bf16 and fp16), strict mode (a fall back raises):
   ``precision="exact"`` bitwise equal to the unpatched model (native paths on GPUs),
   ``precision="fast"`` (Triton: the adaln ops, qk_norm_rope) within 2e-2 of the
   output's scale, as the CPU tests hold it;
2. ``ditops.bench.flux.run`` at ``--size full`` (FLUX.1's 24 heads of 128, 4096 image +
   512 text tokens, one block of each kind, bf16): unpatched, exact, fast interleaved.

A few minutes on an H200 (most of it the first Triton compiles). Without a GPU it runs
on CPU (the exact check and a tiny bench config: a dry run of the script).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "src"))

from tests.integrations.test_diffusers_flux import FAST_REL_TOL, inputs, rel_err, tiny_flux

import ditops
from ditops import config
from ditops.bench import flux

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
CPU = not torch.cuda.is_available()
dev = torch.device("cpu" if CPU else "cuda")
report: dict = {"device": torch.cuda.get_device_name() if not CPU else "cpu", "parity": {}}

for dtype in (torch.bfloat16, torch.float16):
    model = tiny_flux(dtype).to(dev)
    x = {k: v.to(dev) for k, v in inputs(dtype, batch=2).items()}
    with torch.inference_mode():
        ref = model(**x, return_dict=False)[0]
        row = {}
        for precision in ("exact", "fast") if not CPU else ("exact",):
            ditops.patch(model, precision=precision)
            with config.override(strict=True):
                out = model(**x, return_dict=False)[0]
            row[precision] = {"bitwise": bool(torch.equal(out, ref)), "rel": rel_err(out, ref)}
        ditops.unpatch(model)
    report["parity"][str(dtype)] = row
    print(dtype, row, flush=True)
    assert row["exact"]["bitwise"], row
    assert all(r["rel"] <= FAST_REL_TOL for r in row.values()), row

if CPU:  # a dry run: the tiny config
    tiny = dict(attention_head_dim=16, axes_dims_rope=(4, 6, 6), num_attention_heads=2,
                in_channels=8, joint_attention_dim=16, pooled_projection_dim=8)  # fmt: skip
    result = flux.run(dev, "small", rounds=1, image_side=4, text_tokens=3, progress=False, **tiny)
else:
    result = flux.run(dev, "full", progress=False)
flux.print_report(result)
report["bench"] = result
with open(os.path.join(OUT, "flux_gpu.json"), "w") as f:
    json.dump(report, f, indent=1)
print("wrote", os.path.join(OUT, "flux_gpu.json"))
