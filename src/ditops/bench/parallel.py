"""``ditops bench --parallel MODE``: the Wan suite on several devices, under torchrun.

    torchrun --nproc-per-node 2 -m ditops bench --parallel ulysses [--size small] [--model PATH]

MODE is diffusers' context parallelism over the ``P`` ranks torchrun starts: ``ulysses``
(``ulysses_degree=P``), ``ring`` (``ring_degree=P``) or ``unified`` (``ring_degree=2``,
``ulysses_degree=P/2``). Every rank builds the model of the ``wan`` suite twice (the same
weights: :func:`ditops.bench.wan_model.build_model`): one stays a one-process model on the
rank's device, the other gets ``enable_parallelism``. For each step and each of the
variants (unpatched, exact norms, sparse attention: :func:`variants`), the two run the same
denoiser call in turns, and rank 0 prints the seconds per forward of one process and of
the ``P`` ranks (the slowest rank's), the speedup, and the largest difference of the
gathered output from the one-process output of the same variant (parity). A variant
diffusers refuses (Ring where its attention backend gives no log-sum-exp, such as the
native backend on CPU) is listed as refused with diffusers' message; ditops' sparse
attention runs every mode itself (see :mod:`ditops.integrations.shared.parallel`).

The process group is the device's default backend: gloo on CPU, nccl on CUDA, hccl on
Ascend NPUs (torch_npu); nothing else differs. On CPU each rank runs one thread (torchrun
sets ``OMP_NUM_THREADS=1``), and every rank runs the one-process reference at the same
time, so the reference has one core, as each rank has.

Also printed: what the exchange moves and holds per rank (from the shapes: see
:func:`exchange_cost`) and the peak memory each rank saw.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("ulysses", "ring", "unified")
SPARSITY = 0.75


def variants() -> list[tuple[str, dict[str, Any] | None]]:
    """The wan suite's kinds of variant, one sparsity: each costs a one-process and a
    parallel forward per step (benchmarks/cpu/wan_parallel_ulysses.txt and
    wan_parallel_ring.txt record their times, at a smaller video)."""
    from ditops.attention.schedule import BlockSparseConfig
    from ditops.bench import wan

    sparse = BlockSparseConfig(sparsity=SPARSITY, skip_first_steps=wan.SKIP_FIRST_STEPS)
    return [
        ("unpatched", None),
        ("norms exact", {"precision": "exact"}),
        (f"sparse {SPARSITY}", {"precision": "exact", "attention": sparse}),
    ]


class LaunchError(RuntimeError):
    """The parallel bench cannot start as launched; the message says how to launch it."""


def context_parallel_config(mode: str, world: int) -> Any:
    """The ``ContextParallelConfig`` of ``mode`` over ``world`` ranks."""
    from diffusers import ContextParallelConfig

    if world < 2:
        raise LaunchError(f"--parallel {mode} needs at least 2 ranks, torchrun started {world}")
    if mode == "ulysses":
        return ContextParallelConfig(ulysses_degree=world)
    if mode == "ring":
        return ContextParallelConfig(ring_degree=world)
    if mode == "unified":
        if world < 4 or world % 2:
            raise LaunchError(
                f"--parallel unified is ring 2 x ulysses P/2: it needs an even number of "
                f"ranks >= 4, torchrun started {world}"
            )
        return ContextParallelConfig(ring_degree=2, ulysses_degree=world // 2)
    raise LaunchError(f"--parallel must be one of {', '.join(MODES)}, got {mode!r}")


def init_distributed(device_arg: str | None) -> torch.device:
    """Join torchrun's process group on this rank's device; returns the device."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise LaunchError(
            "--parallel runs one process per device under torchrun, e.g. "
            "torchrun --nproc-per-node 2 -m ditops bench --parallel ulysses"
        )
    accelerator = torch.accelerator.current_accelerator()
    kind = torch.device(device_arg).type if device_arg else getattr(accelerator, "type", "cpu")
    if kind == "cpu" and accelerator is not None:
        raise LaunchError(
            f"diffusers' context parallelism builds its device mesh on the accelerator "
            f"({accelerator.type}); run --parallel on it, not on the CPU"
        )
    backend = dist.Backend.default_device_backend_map.get(kind)
    if backend is None:
        raise LaunchError(
            f"no torch.distributed backend is known for {kind} devices "
            f"(known: {dist.Backend.default_device_backend_map})"
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if kind == "cpu" else torch.device(kind, local)
    if kind != "cpu":
        torch.accelerator.set_device_index(local)
    dist.init_process_group(backend, device_id=None if kind == "cpu" else device)
    return device


@dataclass
class Row:
    variant: str
    step: int
    dense: bool
    one_process_s: float
    parallel_s: float
    max_abs: float


def _forward(
    model: Any,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    text: torch.Tensor,
    step: int,
    n_steps: int,
    device: torch.device,
) -> tuple[torch.Tensor, float]:
    """The wan suite's denoiser call at ``step``, all ranks starting together; its
    seconds are the slowest rank's."""
    import torch.distributed as dist

    from ditops.bench.harness import sync
    from ditops.bench.wan_probes import timed_step

    sync(device)
    dist.barrier()
    out, seconds = timed_step(model, latents, timesteps, text, step, n_steps, device)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=latents.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return out, float(slowest)


def exchange_cost(
    *, batch: int, tokens: int, heads: int, head_dim: int, layers: int, world: int, itemsize: int
) -> dict[str, float]:
    """Bytes per rank for one forward's self-attention exchanges (all layers).

    ditops' exchange (and diffusers' Ulysses): q, k, v and the output each move
    ``n (P-1)/P`` elements out and as many in, ``n = B * S/P * H * D``; after it a rank
    holds ``3 n`` of q/k/v. diffusers' Ring all-gathers K/V instead: it receives
    ``2 n (P-1)`` and holds ``2 n P`` of K/V.
    """
    n = batch * (tokens / world) * heads * head_dim * itemsize
    return {
        "exchange_sent_mb": layers * 4 * n * (world - 1) / world / 1e6,
        "exchange_received_mb": layers * 4 * n * (world - 1) / world / 1e6,
        "qkv_held_per_call_mb": 3 * n / 1e6,
        "ring_allgather_received_mb": layers * 2 * n * (world - 1) / 1e6,
        "ring_kv_held_per_call_mb": 2 * n * world / 1e6,
    }


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    # CPU: the process's peak resident set (both models and all activations), in MB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def run(
    mode: str,
    device: torch.device,
    size: str,
    *,
    model_path: str | None = None,
    progress: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Every variant at every step, one process against ``P`` ranks (module docstring)."""
    import torch.distributed as dist

    from ditops.bench import wan
    from ditops.bench.harness import Progress
    from ditops.bench.wan_model import build_model
    from ditops.integrations import patch, unpatch

    rank, world = dist.get_rank(), dist.get_world_size()
    cp_config = context_parallel_config(mode, world)
    single = build_model(model_path, device, dtype)
    parallel = build_model(model_path, device, dtype)
    parallel.enable_parallelism(config=cp_config)
    cfg = single.config
    latent = list(wan.LATENTS[size])
    latent[1] = cfg.in_channels
    gen = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(latent, generator=gen).to(device, dtype)
    text = torch.randn(1, wan.TEXT_TOKENS, cfg.text_dim, generator=gen).to(device, dtype)
    n_steps = wan.STEPS[size]
    timesteps = torch.linspace(999, 0, n_steps).round().to(device)
    todo = variants()
    refused: dict[str, str] = {}
    rows: list[Row] = []
    bar = Progress(len(todo) * n_steps, f"wan --parallel {mode}", progress and rank == 0)

    def use(options: dict[str, Any] | None) -> None:
        for model in (single, parallel):
            unpatch(model)
            if options is not None:
                patch(model, **options)

    def call(model: Any, step: int) -> tuple[torch.Tensor, float]:
        return _forward(model, latents, timesteps, text, step, n_steps, device)

    try:
        for name, options in todo:  # untimed: compiles and first touches
            use(options)
            call(single, n_steps - 1)
            try:
                call(parallel, n_steps - 1)
            except (ValueError, RuntimeError, NotImplementedError) as exc:
                # Every rank raises the same (a backend's refusal): none waits for another.
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                refused[name] = f"{type(exc).__name__}: {first}"
        for i in range(n_steps):
            for name, options in todo:
                bar.step(f"{name} step {i}")
                if name in refused:
                    continue
                use(options)
                dense = options is None or "attention" not in options or i < wan.SKIP_FIRST_STEPS
                # The faster of REPEATS calls each, one process and P ranks in turns.
                timings = []
                for _ in range(wan.REPEATS):
                    out_single, t_single = call(single, i)
                    out_parallel, t_parallel = call(parallel, i)
                    timings.append((t_single, t_parallel))
                max_abs = float((out_parallel.double() - out_single.double()).abs().max())
                best_single, best_parallel = (min(t) for t in zip(*timings))
                rows.append(Row(name, i, dense, best_single, best_parallel, max_abs))
    finally:
        bar.close()
        use(None)
    peak = torch.tensor([_peak_memory_mb(device)], dtype=torch.float64, device=latents.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = latent[2] * (latent[3] // cfg.patch_size[1]) * (latent[4] // cfg.patch_size[2])
    return {
        "mode": mode,
        "world_size": world,
        "backend": str(dist.get_backend()),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "degrees": {"ring": cp_config.ring_degree, "ulysses": cp_config.ulysses_degree},
        "threads_per_rank": torch.get_num_threads(),
        "latent_shape": latent,
        "video_tokens": tokens,
        "layers": cfg.num_layers,
        "steps": n_steps,
        "skip_first_steps": wan.SKIP_FIRST_STEPS,
        "rows": [r.__dict__ for r in rows],
        "summary": _summary(rows),
        "refused": refused,
        "exchange": exchange_cost(
            batch=latent[0],
            tokens=tokens,
            heads=cfg.num_attention_heads,
            head_dim=cfg.attention_head_dim,
            layers=cfg.num_layers,
            world=world,
            itemsize=torch.finfo(dtype).bits // 8,
        ),
        "peak_memory_mb_per_rank": float(peak),
    }


def _ratio(rows: list[Row]) -> float | None:
    """Total one-process seconds over total parallel seconds."""
    return sum(r.one_process_s for r in rows) / sum(r.parallel_s for r in rows) if rows else None


def _summary(rows: list[Row]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == name]
        out.append(
            {
                "variant": name,
                "one_process_s": sum(r.one_process_s for r in mine) / len(mine),
                "parallel_s": sum(r.parallel_s for r in mine) / len(mine),
                "speedup": _ratio(mine),
                "speedup_sparse_steps": _ratio([r for r in mine if not r.dense]),
                "max_abs": max(r.max_abs for r in mine),
                "bitwise_equal": all(r.max_abs == 0 for r in mine),
            }
        )
    return out


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict[str, Any], out: Any = sys.stdout) -> None:
    p = result["world_size"]
    deg = result["degrees"]
    print(
        f"\n== wan --parallel {result['mode']}: {p} ranks (ring {deg['ring']} x ulysses "
        f"{deg['ulysses']}, {result['backend']} on {result['device']}, "
        f"{result['threads_per_rank']} thread(s) per rank), {result.get('dtype', 'bfloat16')}, "
        f"{result['video_tokens']} video "
        f"tokens, latent {result['latent_shape']}, {result['layers']} layers, "
        f"{result['steps']} steps ({result['skip_first_steps']} dense first)",
        file=out,
    )
    print(
        f"{'variant':<13} {'step':>4} {'dense':>5} {'1 proc s':>9} {f'{p} ranks s':>10} "
        f"{'speedup':>8} {'max abs vs 1 proc':>18}",
        file=out,
    )
    for r in result["rows"]:
        speedup = r["one_process_s"] / r["parallel_s"]
        print(
            f"{r['variant']:<13} {r['step']:>4} {str(r['dense']):>5} {r['one_process_s']:>9.2f} "
            f"{r['parallel_s']:>10.2f} {speedup:>8.2f} {r['max_abs']:>18.2e}",
            file=out,
        )
    print(
        f"\n{'variant':<13} {'1 proc s':>9} {f'{p} ranks s':>10} {'speedup':>8} "
        f"{'x sparse steps':>14} {'bitwise':>8} {'max abs':>9}",
        file=out,
    )
    for s in result["summary"]:
        sparse = _f(s["speedup_sparse_steps"], ".2f")
        print(
            f"{s['variant']:<13} {s['one_process_s']:>9.2f} {s['parallel_s']:>10.2f} "
            f"{s['speedup']:>8.2f} {sparse:>14} {str(s['bitwise_equal']):>8} "
            f"{s['max_abs']:>9.2e}",
            file=out,
        )
    for name, why in result["refused"].items():
        print(f"refused by diffusers under {result['mode']}: {name}: {why}", file=out)
    x = result["exchange"]
    print(
        f"\nper rank and forward, self-attention exchange (q, k, v, output; all layers): "
        f"{x['exchange_sent_mb']:.1f} MB sent, {x['exchange_received_mb']:.1f} MB received; "
        f"q/k/v held per call after it: {x['qkv_held_per_call_mb']:.1f} MB",
        file=out,
    )
    print(
        f"  (diffusers' Ring would receive {x['ring_allgather_received_mb']:.1f} MB of K/V per "
        f"forward and hold {x['ring_kv_held_per_call_mb']:.1f} MB of K/V per call)",
        file=out,
    )
    what = "max allocated" if result["device"].startswith("cuda") else "peak RSS, both models"
    print(f"peak memory per rank ({what}): {result['peak_memory_mb_per_rank']:.0f} MB", file=out)


def main(args: Any) -> int:
    """The ``--parallel`` entry of ``ditops bench`` (see :mod:`ditops.cli`)."""
    import torch.distributed as dist

    from ditops.bench.harness import machine_info, write_json
    from ditops.integrations.shared.parallel import cpu_shims

    device = init_distributed(args.device)
    try:
        rank = dist.get_rank()
        if rank == 0:
            print(
                f"ditops bench: wan --parallel {args.parallel} on {dist.get_world_size()} ranks "
                f"({device.type}), size {args.size}",
                file=sys.stderr,
            )
        from ditops.bench.wan_model import default_dtype

        dtype = getattr(args, "dtype", "auto")
        dtype = default_dtype(device) if dtype == "auto" else getattr(torch, dtype)
        with cpu_shims():
            result = run(
                args.parallel,
                device,
                args.size,
                model_path=args.model,
                progress=not args.no_progress,
                dtype=dtype,
            )
        if rank == 0:
            print_report(result)
            if args.json:
                payload = {
                    "machine": machine_info(device),
                    "command": " ".join(sys.argv),
                    "wan_parallel": result,
                }
                write_json(args.json, payload)
                print(f"\nwrote {args.json}", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0
