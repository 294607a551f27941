"""Benchmark ``ditops bench sglang``: the bench Wan (:data:`ditops.bench.wan_model.DEFAULT_CONFIG`,
the ``wan`` suite's latent) as sglang's own ``WanTransformer3DModel``, run by sglang's
stock platform for the host without and with ditops' plugin, dense and with ditops'
``block_sparse_attn``, and the same config as diffusers' ``WanTransformer3DModel`` under
``ditops.patch`` (dense, and with the same block-sparse settings): sglang + ditops against
diffusers + ditops, in one run with the variants interleaved per step; then the per-call
overhead of ditops' forwards against sglang's own at small sizes (q/k-norm ``RMSNorm``,
``MulAdd``, ``FP32LayerNorm``, ``RMSNormNoWeight``, ``RotaryEmbedding``), interleaved,
median of many calls.

Needs sglang's environment (``.ci/sglang`` builds one; 0.5.21 tested). Stock sglang on a
CPU stops at the first norm (its CPU path calls a CPU build of sgl-kernel no registry
serves): the bench says so and gives ditops' sparse/dense ratio. Where stock runs, its
times are the baseline of both ratios. Random weights (sglang's loader is not timed);
the forwards see the same inputs; the sparse variant runs sglang's metadata for each
step (``skip_first_steps`` dense steps first, only sparse steps are compared).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ditops.bench.wan import LATENTS
from ditops.bench.wan_model import DEFAULT_CONFIG, default_dtype

SPARSE = {"sparsity": 0.75, "skip_first_steps": 1}
STEPS = 4
TEXT_TOKENS = 64


def _setup(device: torch.device, tmp: str) -> Any:
    """sglang's process state an in-process DiT needs: global arguments (a folder named
    like a Wan checkpoint picks its config) and a one-rank process group."""
    from sglang.multimodal_gen.runtime.distributed import parallel_state
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args

    folder = Path(tmp) / "Wan2.1-T2V-1.3B-Diffusers"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    args = ServerArgs.from_kwargs(model_path=str(folder), num_gpus=1)
    set_global_server_args(args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    parallel_state.maybe_init_distributed_environment_and_model_parallel(1, 1)
    return args


def _install_plugin() -> None:
    """ditops' hooks applied in this process as sglang's plugin loader applies them; each
    model is built with them on or off (:func:`_switch`)."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

    from ditops.integrations.sglang.plugin import CUSTOM_OP, register_hooks

    if CUSTOM_OP not in HookRegistry._patched:
        register_hooks()
        HookRegistry.apply_hooks()


def _switch(on: bool) -> Any:
    from ditops.integrations.sglang.plugin import forced

    return forced(on)


def _build(
    platform: Any, args: Any, backend: str | None, dtype, device, ditops: bool
) -> torch.nn.Module:
    from sglang.multimodal_gen.configs.models.dits.wanvideo import WanVideoConfig
    from sglang.multimodal_gen.runtime import platforms
    from sglang.multimodal_gen.runtime.models.dits.wanvideo import WanTransformer3DModel

    args.attention_backend = backend
    args.attention_backend_config = dict(SPARSE) if backend else {}
    saved, platforms._current_platform = platforms._current_platform, platform
    try:
        with _switch(ditops):
            config = WanVideoConfig()
            config.update_model_arch(dict(DEFAULT_CONFIG))
            model = WanTransformer3DModel(config, dict(DEFAULT_CONFIG))
    finally:
        platforms._current_platform = saved
    return model.to(device, dtype).eval()


def _diffusers(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The same Wan config as diffusers' model under ``ditops.patch``: dense (ditops'
    default precision, as the plugin runs) and with ``SPARSE``'s block-sparse settings."""
    from ditops.attention.schedule import BlockSparseConfig
    from ditops.bench.wan_model import build_model
    from ditops.integrations import patch

    dense, sparse = build_model(None, device, dtype), build_model(None, device, dtype)
    patch(dense)
    patch(sparse, attention=BlockSparseConfig(**SPARSE))
    return {"diffusers+ditops dense": dense, "diffusers+ditops sparse": sparse}


def _diffusers_step(model: Any, x, text, step: int, sparse: bool) -> None:
    from ditops.integrations import set_step

    if sparse:  # sglang's diffusers (0.37) takes no step_index in cache_context
        set_step(model, step)
    t = torch.tensor([900 - 200 * step], device=x.device)
    model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)


def _metadata(step: int, latent: list[int]) -> Any:
    from ditops.integrations.sglang.attention import DitopsBlockSparseMetadataBuilder

    return DitopsBlockSparseMetadataBuilder().build(
        current_timestep=step,
        skip_first_steps=SPARSE["skip_first_steps"],
        sparsity=SPARSE["sparsity"],
        raw_latent_shape=latent,
        patch_size=DEFAULT_CONFIG["patch_size"],
    )


def cli(device: torch.device, size: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Run the bench, print its table, return the payload."""
    try:
        import sglang.multimodal_gen  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"ditops bench sglang needs sglang's diffusion runtime ({error}); "
            "build its environment with .ci/sglang"
        ) from error
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
    from sglang.multimodal_gen.runtime.platforms import current_platform
    from sglang.multimodal_gen.runtime.server_args import server_args as module

    dtype = dtype or default_dtype(device)
    latent = [1, DEFAULT_CONFIG["in_channels"], *LATENTS[size][2:]]
    _install_plugin()
    platform = current_platform  # sglang's platform for this host, built in
    saved = module._global_server_args
    with tempfile.TemporaryDirectory() as tmp:
        args = _setup(device, tmp)
        models = {
            "stock": _build(platform, args, None, dtype, device, False),
            "ditops dense": _build(platform, args, None, dtype, device, True),
            "ditops sparse": _build(platform, args, "block_sparse_attn", dtype, device, True),
        }
        state = models["stock"].state_dict()
        g = torch.Generator().manual_seed(0)
        for p in state.values():
            p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
        for model in models.values():
            model.load_state_dict(state)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(latent, generator=gen).to(device, dtype)
        text = torch.randn(1, TEXT_TOKENS, DEFAULT_CONFIG["text_dim"], generator=gen)
        text = text.to(device, dtype)
        models.update(_diffusers(device, dtype))
        times: dict[str, list[float]] = {name: [] for name in models}
        failures: dict[str, str] = {}
        for step in range(STEPS):
            for name, model in models.items():
                if name in failures:
                    continue
                md = _metadata(step, latent) if name == "ditops sparse" else None
                start = time.perf_counter()
                try:
                    if name.startswith("diffusers"):
                        with torch.no_grad():
                            _diffusers_step(model, x, text, step, name.endswith("sparse"))
                    else:
                        with torch.no_grad(), set_forward_context(step, md, None):
                            model(x, text, torch.tensor([900 - 200 * step], device=device))
                except Exception as error:
                    if name != "stock":
                        raise
                    failures[name] = f"{type(error).__name__}: {error}"
                    continue
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if step >= SPARSE["skip_first_steps"]:
                    times[name].append(time.perf_counter() - start)
    module._global_server_args = saved
    best = {name: min(t) for name, t in times.items() if t}
    base = "stock" if "stock" in best else "ditops dense"
    rows = [
        {
            "variant": name,
            "seconds": best.get(name),
            "failed": failures.get(name),
            "speedup": best[base] / best[name] if name in best else None,
        }
        for name in models
    ]
    load = os.getloadavg()[0]
    print(
        f"ditops bench sglang: Wan {DEFAULT_CONFIG['num_layers']} layers, latent {latent}, "
        f"{dtype}, {device}, sparse {SPARSE}, speedup vs {base}, load {load:.1f}"
    )
    for row in rows:
        if row["speedup"] is None:
            print(f"  {row['variant']:<24} fails: {row['failed']}")
        else:
            print(f"  {row['variant']:<24} {row['seconds']:8.3f} s  {row['speedup']:.2f}x")
    overhead = _overhead(platform, dtype)
    print("  per call (median us), sglang's own forward vs ditops':")
    for name, (own, ours) in overhead.items():
        print(f"  {name:<34} {own:8.1f} {ours:8.1f}  {ours - own:+7.1f}")
    return {
        "rows": rows, "latent": latent, "dtype": str(dtype), "sparse": SPARSE, "base": base,
        "overhead_us": overhead,
    }  # fmt: skip


def _overhead(platform: Any, dtype: torch.dtype, calls: int = 2000) -> dict[str, tuple]:
    """Median microseconds per call of sglang's own forward (its platform's where that runs,
    else ``forward_native``) and of ditops', at sizes where Python work dominates."""
    import torch._dynamo
    from sglang.multimodal_gen.runtime import platforms
    from sglang.multimodal_gen.runtime.layers import layernorm as ln
    from sglang.multimodal_gen.runtime.layers.elementwise import MulAdd
    from sglang.multimodal_gen.runtime.layers.rotary_embedding.base import RotaryEmbedding

    cases = {
        "RMSNorm q/k [1, 256, 128]": (lambda: ln.RMSNorm(128), (torch.randn(1, 256, 128),)),
        "MulAdd [1, 256, 256]": (
            MulAdd,
            (torch.randn(1, 256, 256), torch.randn(1, 1, 256), torch.randn(1, 256, 256)),
        ),
        "FP32LayerNorm [1, 256, 256]": (
            lambda: ln.FP32LayerNorm(256, elementwise_affine=True),
            (torch.randn(1, 256, 256),),
        ),
        "RMSNormNoWeight [1, 256, 128]": (
            ln.RMSNormNoWeight,
            (torch.randn(1, 256, 128), 1e-6),
        ),
        "RotaryEmbedding q/k [1, 256, 8, 64]": (
            lambda: RotaryEmbedding(64, 64, 4096, 10000, use_precomputed_cache=False),
            (None, torch.randn(1, 256, 8, 64), torch.randn(1, 256, 8, 64), 0)
            + tuple(torch.rand(256, 32).cos() for _ in range(2)),
        ),
    }
    out = {}
    saved, platforms._current_platform = platforms._current_platform, platform
    try:
        for name, (factory, inputs) in cases.items():
            with _switch(False):
                own = factory()
            with _switch(True):
                ours = factory()
            # Activations in the bench dtype; the rotary tables ([S, D / 2]) stay fp32.
            xs = [t.to(dtype) if torch.is_tensor(t) and t.dim() > 2 else t for t in inputs]
            try:
                own(*xs)
            except (AttributeError, ModuleNotFoundError, RuntimeError):  # sgl_kernel absent
                own._forward_method = own.forward_native
            times: dict[str, list[float]] = {"own": [], "ours": []}
            # sglang's forward_native bodies carry torch.compile: eager, as sglang's CPU
            # platform runs them (dynamo's per-call guard cost is not the op's).
            with torch.no_grad(), torch._dynamo.config.patch(disable=True):
                for _ in range(calls):
                    for key, module in (("own", own), ("ours", ours)):
                        start = time.perf_counter()
                        module(*xs)
                        times[key].append(time.perf_counter() - start)
            out[name] = tuple(sorted(t)[len(t) // 2] * 1e6 for t in times.values())
    finally:
        platforms._current_platform = saved
    return out
