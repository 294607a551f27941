"""``ditops tune``: time a model's shape classes ahead of time (:mod:`ditops.core.tune`).

Builds the ``ditops bench wan`` model (or ``--model PATH``), patches it as the bench does
(the fused norms, block-sparse self-attention at sparsity 0.75) in each precision asked
for, and runs one forward at a sparse step with ``DITOPS_TUNE=on``: every op call whose
shape class has no choice yet times its competitors then (FlexAttention's compile
included), and the choices land in the cache file. Later runs of the same shapes, in any
process on this machine, start from them.
"""

from __future__ import annotations

import torch

from ditops import config
from ditops.core import tune


def tune_wan(
    device: torch.device,
    size: str,
    precisions: tuple[str, ...],
    dtype: torch.dtype,
    model_path: str | None = None,
) -> dict[str, tune.Choice]:
    """Tune the bench Wan's shapes; returns the choices measured (class key -> choice)."""
    from ditops.bench.wan import LATENTS, TEXT_TOKENS, _sparse
    from ditops.bench.wan_model import build_model, make_inputs
    from ditops.bench.wan_probes import timed_step
    from ditops.integrations import patch, unpatch

    model = build_model(model_path, device, dtype)
    inputs = make_inputs(model.config, LATENTS[size][2:], TEXT_TOKENS, device, dtype)
    steps = torch.linspace(999, 0, 2).round().to(device)
    before = set(tune.choices())
    try:
        for precision in precisions:
            unpatch(model)
            patch(model, precision=precision, attention=_sparse(0.75))
            with config.override(tune="on"):
                timed_step(
                    model,
                    inputs["hidden_states"],
                    steps,
                    inputs["encoder_hidden_states"],
                    1,  # a sparse step (the bench's configs skip the first)
                    2,
                    device,
                )
    finally:
        unpatch(model)
    return {k: c for k, c in tune.choices().items() if k not in before or c.source == "measured"}
