"""Everything a lent GPU should tell us, in one command (issue 39, item 5).

    PYTHONUNBUFFERED=1 python benchmarks/gpu/run_all.py OUT_DIR [--budget 540]

Writes OUT_DIR/gpu_all.json after every section (a run cut short keeps what it has) and
prints one line per measurement. Sections, in order, each skipped once the time budget
(default 540 s, under the 10 minutes a device run gets) is spent:

1. ``ops``: every op the Wan and FLUX patches run, at their shapes (bf16 Wan
   ``[1, 8064, 1536]``, FLUX ``[1, 4608, 3072]``, heads of 128), in exact and fast
   precision: the meaning (``forward_native``), ``torch.compile`` of the meaning, ditops
   with static launch configs (``DITOPS_TUNE=off``) and tuned (``on``, cache in OUT_DIR),
   plus a copy of the call's first tensor (the memory roofline's scale). Milliseconds,
   medians.
2. ``tuned``: the launch configs the tuner chose in section 1, with the times behind them.
3. ``attention``: block-sparse attention against dense SDPA at 8k, 16k and 32k tokens
   ([1, 12, S, 128] bf16, random masks, keep 0.5 / 0.25 / 0.1, first call's time too),
   and the estimate's share of dense.
4. ``per_call``: the cost of one call at small shapes (q/k norms per head, modulation
   vectors), ditops against the plain torch expression, microseconds per call.
5. ``models``: one Wan forward (``ditops bench wan``'s model: 2 layers, dim 1536, 8064
   video tokens) and one FLUX forward (one block of each kind, 4096 + 512 tokens),
   unpatched against patched exact and fast, interleaved, bf16; Wan also sparse 0.75.

``--dry-run`` (what the test runs on a CPU under ``TRITON_INTERPRET=1``): tiny shapes, CPU
tensors dispatched as CUDA (``ditops.force_device_kind``) so the Triton paths run in
Triton's interpreter, ``torch.compile`` with the eager backend, one repetition: it shows
the script cannot crash for a reason a CPU can see, not a single figure.
"""

from __future__ import annotations

# ruff: noqa: B023, E501 - closures timed in the iteration that made them; one case a line
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402 - after the path set-up
import torch.nn.functional as F  # noqa: E402

RESULT: dict[str, Any] = {}
T0 = time.time()
EPS = 1e-6


class Ctx:
    """The run's settings: device, shapes, repetitions, time budget, output folder."""

    def __init__(self, out: str, dry: bool, budget: float) -> None:
        self.out, self.dry, self.budget = out, dry, budget
        self.dev = torch.device("cpu" if dry else "cuda")
        self.reps = 1 if dry else 20
        self.warmup = 1 if dry else 3

    def left(self) -> float:
        return self.budget - (time.time() - T0)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], reps: int | None = None) -> float:
        """Median milliseconds of ``fn`` (synchronised), after warm-up calls."""
        reps = self.reps if reps is None else reps
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    def compile(self, fn: Callable[[], object]) -> Callable[[], object]:
        # Every case compiles the same lambda's code with other objects: without room for
        # recompiles dynamo would stop compiling after 8 and run the rest eagerly.
        torch._dynamo.config.recompile_limit = 1000
        torch._dynamo.config.accumulated_recompile_limit = 10000
        return torch.compile(fn, backend="eager" if self.dry else "inductor")

    @contextlib.contextmanager
    def dispatch(self) -> Iterator[None]:
        """In a dry run, CPU tensors take the CUDA paths (Triton's interpreter)."""
        if not self.dry:
            yield
            return
        import ditops

        with ditops.force_device_kind({"cpu": "cuda"}):
            yield


def save(ctx: Ctx) -> None:
    RESULT["elapsed_s"] = round(time.time() - T0, 1)
    with open(os.path.join(ctx.out, "gpu_all.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def _rand(gen: torch.Generator, *shape: int, dtype=torch.bfloat16, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype)


def op_cases(ctx: Ctx) -> dict[str, tuple[Any, tuple, dict]]:
    """name -> (public op, args, kwargs): the ops of the Wan and FLUX patches."""
    import ditops

    gen = torch.Generator().manual_seed(0)
    D = 16 if ctx.dry else 128
    cases: dict[str, tuple[Any, tuple, dict]] = {}
    wan = (24, 2) if ctx.dry else (8064, 12)
    flux = (20, 2) if ctx.dry else (4608, 24)
    for model, (L, H) in (("wan", wan), ("flux", flux)):
        C = H * D if model == "wan" else 2 * H * D
        dev = ctx.dev
        h, a, ff = (_rand(gen, 1, L, C).to(dev) for _ in range(3))
        q, k = (_rand(gen, 1, L, H, D).to(dev) for _ in range(2))
        ang = (torch.rand(L, D // 2, generator=gen) * 6.28).to(dev)
        if model == "wan":
            mod_dt = torch.float32
            s, t, g = (_rand(gen, 1, 1, C, dtype=mod_dt, scale=0.1).to(dev) for _ in range(3))
            w = _rand(gen, C, dtype=mod_dt, shift=1.0).to(dev)
            b = _rand(gen, C, dtype=mod_dt).to(dev)
            wq, wk = (_rand(gen, H * D, scale=0.3, shift=1.0).to(dev) for _ in range(2))
            cases.update({
                "wan layer_norm_scale_shift": (ditops.layer_norm_scale_shift, (h, None, None, s, t, EPS), {}),
                "wan fused norm2": (ditops.scale_residual_layer_norm_scale_shift, (h, a, g, w, b, None, None, EPS), {}),
                "wan fused norm3": (ditops.scale_residual_layer_norm_scale_shift, (h, a, 1, None, None, s, t, EPS), {}),
                "wan gated_residual": (ditops.gated_residual, (h, ff, g), {}),
                "wan qk_norm_rope": (ditops.qk_norm_rope, (q, k, wq, wk, ang.cos(), ang.sin(), EPS), {"across_heads": True}),
                "wan fp32_layer_norm": (ditops.fp32_layer_norm, (h, (C,), None, None, EPS), {}),
            })  # fmt: skip
        else:
            s, t, g = (_rand(gen, 1, 1, C, scale=0.1).to(dev) for _ in range(3))
            wq, wk = (_rand(gen, D, scale=0.3, shift=1.0).to(dev) for _ in range(2))
            cases.update({
                "flux adaln_modulate": (ditops.adaln_modulate, (h, s, t, EPS), {}),
                "flux adaln_residual": (ditops.adaln_residual, (h, a, g), {}),
                "flux adaln_residual_modulate": (ditops.adaln_residual_modulate, (h, a, g, s, t, EPS), {}),
                "flux qk_norm_rope": (ditops.qk_norm_rope, (q, k, wq, wk, ang.cos(), ang.sin(), EPS), {}),
                "flux rms_norm": (ditops.rms_norm, (q, wq, EPS), {}),
            })  # fmt: skip
    return cases


def ops_section(ctx: Ctx) -> None:
    from ditops import config

    def tuned(op: Any, call: Any, precision: str) -> float:
        """The op's time with tuning on (its first call, in the warm-up, tunes)."""
        saved = getattr(config._local, "override", None)
        config._local.override = config.replace(tuned_cfg, precision=precision)
        try:
            return ctx.time(lambda: op.run(call))
        finally:
            config._local.override = saved

    rows: list[dict[str, Any]] = []
    RESULT["ops"] = rows
    tuned_cfg = config.replace(config.get(), tune="on", cache_dir=os.path.join(ctx.out, "tune"))
    with torch.inference_mode(), ctx.dispatch():
        for name, (fn, args, kw) in op_cases(ctx).items():
            if ctx.left() < 60:
                RESULT["ops_cut"] = f"stopped before {name}: budget"
                break
            op = fn.op
            for precision in ("exact", "fast"):
                with config.override(precision=precision):
                    call = op.prepare(*args, **kw)
                    first = call.tensors()[0]
                    meaning = ctx.compile(lambda: op.forward_native(call))
                    row: dict[str, Any] = {"case": name, "precision": precision}
                    row["path"] = op.explain_call(*args, **kw).chosen
                    row["copy_ms"] = ctx.time(lambda: first.clone())
                    row["meaning_ms"] = ctx.time(lambda: op.forward_native(call))
                    row["compile_ms"] = ctx.time(meaning)
                    with config.override(tune="off"):
                        row["ditops_ms"] = ctx.time(lambda: op.run(call))
                    # The tuner waits for the tensors' own device (nothing for a dry run's
                    # CPU tensors dressed as CUDA), so the dry run tunes too.
                    row["tuned_ms"] = tuned(op, call, precision)
                for k in ("compile_ms", "ditops_ms", "tuned_ms"):
                    row[k.replace("_ms", "_x_meaning")] = row["meaning_ms"] / max(row[k], 1e-9)
                rows.append(row)
                print(json.dumps(row), flush=True)
            save(ctx)
    from ditops.core import tune

    found = tune.choices(tuned_cfg)
    RESULT["tuned"] = {k: {"winner": v.winner, "why": v.why()} for k, v in found.items()}
    save(ctx)


def attention_section(ctx: Ctx) -> None:
    from ditops.layers.sparse_attention import dense_attention
    from ditops.ops.block_sparse_attention import block_sparse_attention
    from ditops.ops.estimate_block_mask import estimate_block_mask

    rows: list[dict[str, Any]] = []
    RESULT["attention"] = rows
    heads, D = (2, 32) if ctx.dry else (12, 128)
    sizes = (256,) if ctx.dry else (8192, 16384, 32768)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode(), ctx.dispatch():
        for S in sizes:
            if ctx.left() < 90:
                RESULT["attention_cut"] = f"stopped before S={S}: budget"
                break
            q, k, v = (_rand(gen, 1, heads, S, D).to(ctx.dev) for _ in range(3))
            row: dict[str, Any] = {"S": S, "dense_ms": ctx.time(lambda: dense_attention(q, k, v))}
            nb = -(-S // 128)
            for keep in (0.5, 0.25, 0.1):
                m = (torch.rand(1, heads, nb, nb, generator=gen) < keep).to(torch.int8)
                m[..., 0] = 1
                m = m.to(ctx.dev)
                cnt = m.sum(-1, dtype=torch.int32)
                t = time.time()
                block_sparse_attention(q, k, v, m, cnt)
                ctx.sync()
                row[f"first_call_s_keep{keep}"] = round(time.time() - t, 2)
                ms = ctx.time(lambda: block_sparse_attention(q, k, v, m, cnt))
                row[f"sparse_ms_keep{keep}"] = ms
                row[f"x_dense_keep{keep}"] = row["dense_ms"] / ms
            est = ctx.time(lambda: estimate_block_mask(q, k, keep_ratio=0.25))
            row["estimate_ms"], row["estimate_share_of_dense"] = est, est / row["dense_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(ctx)


def per_call_section(ctx: Ctx) -> None:
    import ditops

    rows: list[dict[str, Any]] = []
    RESULT["per_call"] = rows
    dev, bf16 = ctx.dev, torch.bfloat16
    x = torch.randn(4, 64, device=dev, dtype=bf16)
    r = torch.randn(1, 8, 64, device=dev, dtype=bf16)
    w = torch.randn(64, device=dev, dtype=bf16)
    h = torch.randn(1, 16, 64, device=dev, dtype=bf16)
    s, t = (torch.randn(1, 1, 64, device=dev) * 0.1 for _ in range(2))

    def rms(x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return ((x.float() * torch.rsqrt(v + EPS)).to(w.dtype) * w).to(x.dtype)

    def ln_mod(h: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(h.float(), (64,), eps=EPS)
        return (y * (1 + s) + t).type_as(h)

    cases = {
        "fp32_layer_norm [4, 64]": (
            lambda: F.layer_norm(x.float(), (64,), eps=EPS).to(bf16),
            lambda: ditops.fp32_layer_norm(x, (64,), None, None, EPS),
        ),
        "rms_norm [1, 8, 64]": (lambda: rms(r), lambda: ditops.rms_norm(r, w, EPS)),
        "layer_norm_scale_shift [1, 16, 64]": (
            lambda: ln_mod(h),
            lambda: ditops.layer_norm_scale_shift(h, None, None, s, t, EPS),
        ),
    }
    n = 2 if ctx.dry else 200
    with torch.inference_mode(), ctx.dispatch():
        for name, (eager, ours) in cases.items():
            row: dict[str, Any] = {"case": name}
            for label, fn in (("eager_us", eager), ("ditops_us", ours)):

                def many() -> None:
                    for _ in range(n):
                        fn()

                row[label] = ctx.time(many, reps=1 if ctx.dry else 5) * 1e3 / n
            row["ditops_over_eager"] = row["ditops_us"] / max(row["eager_us"], 1e-9)
            rows.append(row)
            print(json.dumps(row), flush=True)
    save(ctx)


def _interleaved(ctx: Ctx, fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds per variant, the variants taking turns each round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(ctx.time(fn, reps=1))
    return {k: statistics.median(v) for k, v in times.items()}


def models_section(ctx: Ctx) -> None:
    from ditops.attention.schedule import BlockSparseConfig
    from ditops.bench import flux, wan_model
    from ditops.integrations import patch

    RESULT["models"] = out = {}
    dev, dt = ctx.dev, torch.bfloat16
    rounds = 1 if ctx.dry else 5
    if ctx.dry:
        tiny = {"num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64,
                "text_dim": 32, "num_layers": 1, "freq_dim": 32}  # fmt: skip
        wan_cfg, latent, text = tiny, (2, 4, 4), 4
    else:
        wan_cfg, latent, text = {}, (21, 32, 48), 512
    base = wan_model.build_model(None, dev, dt, **wan_cfg)
    inputs = wan_model.make_inputs(base.config, latent, text, dev, dt)
    models = {"unpatched": base}
    for name, kw in (
        ("exact", {"precision": "exact"}),
        ("fast", {"precision": "fast"}),
        ("sparse 0.75", {"precision": "exact", "attention": BlockSparseConfig(sparsity=0.75)}),
    ):
        m = wan_model.build_model(None, dev, dt, **wan_cfg)
        patch(m, **kw)
        models[name] = m

    def fwd(m: torch.nn.Module) -> Callable[[], object]:
        return lambda: m(**inputs, return_dict=False)[0]

    with torch.inference_mode(), ctx.dispatch():
        ms = _interleaved(ctx, {k: fwd(m) for k, m in models.items()}, rounds)
    out["wan"] = {"ms": ms, "x_unpatched": {k: ms["unpatched"] / v for k, v in ms.items()}}
    print(json.dumps(out["wan"]), flush=True)
    save(ctx)
    if ctx.left() < 60:
        RESULT["models_cut"] = "FLUX skipped: budget"
        return
    if ctx.dry:
        kw = dict(attention_head_dim=16, axes_dims_rope=(4, 6, 6), num_attention_heads=2,
                  in_channels=8, joint_attention_dim=16, pooled_projection_dim=8)  # fmt: skip
        with ctx.dispatch():
            res = flux.run(
                dev, "small", rounds=1, image_side=4, text_tokens=3, progress=False, **kw
            )
    else:
        res = flux.run(dev, "full", progress=False)
    out["flux"] = {"summary": res.get("summary"), "rows": res.get("rows")}
    print(json.dumps(out["flux"]["summary"], default=str), flush=True)
    save(ctx)


SECTIONS = {
    "ops": ops_section,
    "attention": attention_section,
    "per_call": per_call_section,
    "models": models_section,
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=".")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all sections")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (tests)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ctx = Ctx(args.out, args.dry_run, args.budget)
    RESULT["device"] = "cpu (dry run)" if ctx.dry else torch.cuda.get_device_name()
    RESULT["torch"] = torch.__version__
    for name in args.sections.split(","):
        if ctx.left() <= 0:
            RESULT[f"{name}_skipped"] = "budget spent"
            continue
        t = time.time()
        try:
            SECTIONS[name](ctx)
        except Exception as exc:  # on a device: record, go on to the next
            if ctx.dry:
                raise
            import traceback

            RESULT[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"{name} failed: {exc}", flush=True)
        print(f"{name}: {time.time() - t:.0f} s", flush=True)
        save(ctx)
    return RESULT


if __name__ == "__main__":
    main()
