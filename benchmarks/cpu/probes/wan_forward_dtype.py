"""One forward of ``ditops bench``'s default Wan model in a dtype (why --dtype auto exists).

    python benchmarks/cpu/probes/wan_forward_dtype.py float32
    python benchmarks/cpu/probes/wan_forward_dtype.py bfloat16

Two unpatched forwards at the default video (8064 tokens), seconds each.
"""

from __future__ import annotations

import sys
import time

import torch

from ditops.bench import wan, wan_model

dtype = getattr(torch, sys.argv[1])
torch.manual_seed(0)
model = wan_model.build_model(None, torch.device("cpu"), dtype)
latents = torch.randn(wan.LATENTS["small"]).to(dtype)
text = torch.randn(1, wan.TEXT_TOKENS, model.config.text_dim).to(dtype)
with torch.inference_mode():
    for _ in range(2):
        t = time.perf_counter()
        model(latents, torch.tensor([500]), text, return_dict=False)
        print(sys.argv[1], f"{time.perf_counter() - t:.1f} s", flush=True)
