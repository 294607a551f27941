"""The families that modulate an RMSNorm run ``rms_norm_scale`` (issue 39, item 3): Mochi's
modulated norms (``(rms(x.float()) * s).to(dtype)``), Z-Image's ``norm1(x) * scale``,
LTX-Video's ``norm(h) * (1 + c) + s``. Spies show the fused op's CPU path running the
expected number of times per forward, and the exact patch stays bitwise the unpatched
model in every dtype the family runs (the family files check the rest of each patch)."""

from __future__ import annotations

import pytest
import torch

import ditops
from tests.integrations.spies import cpu_paths_of

pytest.importorskip("diffusers", reason="the diffusers extra is part of the test install")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
cpu_paths = cpu_paths_of("rms_norm_scale", "rms_norm")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mochi_modulated_norms_run_fused(dtype: str, cpu_paths: dict[str, int]) -> None:
    from tests.integrations.test_diffusers_mochi import inputs, run, tiny_mochi

    model = tiny_mochi(DTYPES[dtype])
    x = inputs(DTYPES[dtype])
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    # block 0: norm1, norm1_context (zero), norm2-4 of both streams; block 1 (the last,
    # context_pre_only): norm1, the text's continuous norm, norm2-4 of the video stream.
    # Left on rms_norm: the text q/k norms of both attentions (no scale).
    assert cpu_paths == {"rms_norm_scale": 8 + 5, "rms_norm": 2 * 2}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_z_image_modulated_norms_run_fused(dtype: str, cpu_paths: dict[str, int]) -> None:
    from tests.integrations.test_diffusers_z_image import inputs, run, same, tiny_z_image

    model = tiny_z_image(DTYPES[dtype])
    x = inputs(DTYPES[dtype])
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert same(run(model, **x), ref)
    # 4 blocks, 3 with modulation (the noise refiner, 2 main layers): attention_norm1 and
    # ffn_norm1 times their scales; the other two norms and the context refiner's 4 plain.
    assert cpu_paths == {"rms_norm_scale": 3 * 2, "rms_norm": 3 * 2 + 4}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_z_image_omni_per_token_scales_run_fused(dtype: str, cpu_paths: dict[str, int]) -> None:
    from tests.integrations.test_diffusers_z_image import omni_inputs, run, same, tiny_z_image

    model = tiny_z_image(DTYPES[dtype], siglip_feat_dim=20)
    x = omni_inputs(DTYPES[dtype])
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert same(run(model, **x), ref)
    assert cpu_paths["rms_norm_scale"] > 0


@pytest.mark.parametrize(
    ("dtype", "batch", "per_token"),
    [("fp32", 1, False), ("bf16", 1, False), ("bf16", 2, True), ("fp16", 2, False)],
)
def test_ltx_video_modulated_norms_run_fused(
    dtype: str, batch: int, per_token: bool, cpu_paths: dict[str, int]
) -> None:
    from tests.integrations.test_diffusers_ltx_video import inputs, run, tiny_ltx

    model = tiny_ltx(DTYPES[dtype])
    x = inputs(DTYPES[dtype], batch=batch, per_token=per_token)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == {"rms_norm_scale": 2 * 2}  # norm1 and norm2 of both blocks


def test_ltx_video_norms_with_weights_run_fused(cpu_paths: dict[str, int]) -> None:
    from tests.integrations.test_diffusers_ltx_video import inputs, run, tiny_ltx

    model = tiny_ltx(torch.bfloat16, norm_elementwise_affine=True)
    with torch.no_grad():
        for block in model.transformer_blocks:
            for norm in (block.norm1, block.norm2):
                norm.weight.normal_(1.0, 0.3)
    x = inputs(torch.bfloat16)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert torch.equal(run(model, **x), ref)
    assert cpu_paths == {"rms_norm_scale": 2 * 2}


@pytest.mark.parametrize(
    ("dtype", "batch", "variant"),
    [("fp32", 1, "plain"), ("bf16", 2, "plain"), ("fp16", 1, "plain"), ("bf16", 2, "ltx23")],
)
def test_ltx2_modulated_norms_run_fused(
    dtype: str, batch: int, variant: str, cpu_paths: dict[str, int]
) -> None:
    from tests.integrations.test_diffusers_ltx2 import VARIANTS, equal, inputs, run, tiny_ltx2

    model = tiny_ltx2(DTYPES[dtype], **VARIANTS[variant])
    x = inputs(DTYPES[dtype], batch=batch)
    ref = run(model, **x)
    ditops.patch(model, precision="exact")
    assert equal(run(model, **x), ref)
    # per stream and block: the self-attention's and the feed-forward's norms times
    # (1 + scale) plus shift; the text and cross-modal norms stay plain
    assert cpu_paths == {"rms_norm_scale": 2 * 2 * 2, "rms_norm": 2 * 2 * 2}
