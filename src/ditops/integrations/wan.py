"""Patching diffusers' ``WanTransformer3DModel`` (Wan2.1, Wan2.2 A14B / TI2V, I2V) and the
models built of its blocks: ``WanVACETransformer3DModel``, ``SkyReelsV2Transformer3DModel``,
``ChronoEditTransformer3DModel``, ``WanAnimateTransformer3DModel``.

Each ``WanTransformerBlock`` computes, around its three sub-layers (diffusers 0.42)::

    n = (norm1(h.float()) * (1 + scale_msa) + shift_msa).type_as(h)
    h = (h.float() + attn1(n) * gate_msa).type_as(h)
    n = norm2(h.float()).type_as(h)
    h = h + attn2(n, text)
    n = (norm3(h.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(h)
    h = (h.float() + ffn(n).float() * c_gate_msa).type_as(h)

The patched block runs the same expressions on ditops' fused ops, each read once and
rounded once: ``layer_norm_scale_shift`` for the first line, the fused
``scale_residual_layer_norm_scale_shift`` for lines 2-3 and 4-5 (gate 1 for the plain
residual add, which is the same fp32 add rounded once), and ``gated_residual`` for the
last. In exact precision each is bitwise equal to those eager expressions.

Self-attention (``attn1``) gets a processor of ditops' (:class:`WanSelfAttnProcessor`,
wrapping diffusers' ``WanAttnProcessor``): with the fused blocks, ``norm_q``/``norm_k``
and the rotary embedding run as one ``qk_norm_rope`` op (bitwise in exact precision);
with ``attention=BlockSparseConfig(...)``, ditops'
:class:`~ditops.layers.sparse_attention.BlockSparseAttention` runs on the sparse steps.

The derived models are recognised by what their code does, not by their names: a block
is fused when the fingerprint of its class's forward is one this module has a fused twin
of (``WanTransformerBlock``'s, which ChronoEdit and Wan-Animate copy under the same name;
``WanVACETransformerBlock``'s: input projection, Wan's chain over the control states,
output projection making the hint; ``SkyReelsV2TransformerBlock``'s: Wan's chain with
diffusion forcing's per-frame modulation ``[B, 6, L, C]`` and the causal frame-block mask
handed to self-attention), and a processor is wrapped when its class and the fingerprint
of its ``__call__`` (and of its module's ``_get_qkv_projections``) are known. What the
models add around the blocks (VACE's hint sums, Wan-Animate's face adapters and motion
encoder, SkyReels-V2's fps embedding) runs as diffusers runs it.

Before changing anything, :meth:`WanFamily.check` compares every block and processor
against what this module was written for (types, sub-modules and fingerprints of the
block forwards and processors): a model that does not match is refused whole, with the
reason. Blocks already wrapped by diffusers or
accelerate hooks (caching, offloading, context parallelism) are patched under the hooks.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ditops.integrations.base import (
    AttrSet,
    Bypass,
    PatchOptions,
    PatchRecord,
    WrappingProcessor,
    fingerprint,
    forward_wrapper_problem,
    install_guarded,
    refuse,
    register_like,
)
from ditops.integrations.norms import swap_norms
from ditops.integrations.parallel import attend_across_ranks, context_parallel_of
from ditops.integrations.steps import StepState, track_steps

logger = logging.getLogger("ditops")

# base.fingerprint of the diffusers versions this module was checked against.
#: ``WanTransformerBlock.forward`` (also the copies ChronoEdit and Wan-Animate define).
KNOWN_BLOCK_FORWARD = {"318f5cac859c98ee": "diffusers 0.42"}
#: ``WanAttnProcessor.__call__``; ChronoEdit's copy differs in comments only; SkyReels-V2's
#: differs where it hands the context-parallel config to cross-attention (a path ditops
#: leaves to it: its self-attention lines are Wan's).
KNOWN_ATTN_PROCESSOR = {
    "860a708317404b68": "diffusers 0.42",
    "967be14b865ec52b": "diffusers 0.42 (ChronoEdit's copy)",
    "d79f607e6be35244": "diffusers 0.42 (SkyReels-V2's copy)",
}
#: ``WanVACETransformerBlock.forward``: proj_in, Wan's chain on the control states, proj_out.
KNOWN_VACE_BLOCK_FORWARD = {"2d4df54a15edd0a2": "diffusers 0.42"}
#: ``SkyReelsV2TransformerBlock.forward``: Wan's chain, per-frame modulation ``[B, 6, L, C]``
#: (diffusion forcing) and the attention mask (causal blocks) handed to self-attention.
KNOWN_SKYREELS_BLOCK_FORWARD = {"bc0ba5d9174f9e38": "diffusers 0.42"}
#: ``_get_qkv_projections`` of transformer_wan (and its copies), which ditops' processor calls.
KNOWN_QKV_PROJECTIONS = {
    "12c562d8104ff115": "diffusers 0.42",
    "ddd1a543e6e3b145": "diffusers 0.42 (SkyReels-V2's copy: its type annotation)",
}

#: The models of this family (diffusers' class names). A model is also taken when its
#: blocks' forward is one ditops knows; either way every block and processor is checked by
#: fingerprint, never by name alone.
MODEL_CLASSES = (
    "WanTransformer3DModel",
    "WanVACETransformer3DModel",
    "SkyReelsV2Transformer3DModel",
    "ChronoEditTransformer3DModel",
    "WanAnimateTransformer3DModel",
)


@dataclass(frozen=True)
class BlockKind:
    """A block forward ditops has a fused twin of: ``fused`` runs the same arithmetic."""

    label: str  # what the class's forward is, in messages
    known: dict[str, str]  # its fingerprints -> the diffusers versions checked
    fused: Any  # the fused forward (module-level, installed through install_guarded)
    kind: str  # counted as "fused <kind>" / "unfused <kind>"


@dataclass
class WanPlan:
    #: (place, block, kind) of every block whose self-attention processor is ditops'.
    blocks: list[tuple[str, nn.Module, BlockKind]] = field(default_factory=list)
    #: place -> why its forward cannot be fused (it runs diffusers' forward).
    unfused: dict[str, str] = field(default_factory=dict)
    #: ditops' processor class for each place (one per diffusers processor class).
    processors: dict[str, type] = field(default_factory=dict)
    #: count steps from the timesteps of calls that bring no step index (Wan's I2V pipeline
    #: and the Wan-derived models' pipelines call the model without one)
    count_steps: bool = False


#: What the fused block computes without calling it (see :class:`~.base.Bypass`).
BLOCK_BYPASSES = ("norm1", "norm2", "norm3")


def _block_kinds() -> tuple[BlockKind, ...]:
    return (
        BlockKind(
            "WanTransformerBlock.forward", KNOWN_BLOCK_FORWARD, fused_block_forward, "blocks"
        ),
        BlockKind(
            "WanVACETransformerBlock.forward",
            KNOWN_VACE_BLOCK_FORWARD,
            fused_vace_block_forward,
            "vace blocks",
        ),
        BlockKind(
            "SkyReelsV2TransformerBlock.forward",
            KNOWN_SKYREELS_BLOCK_FORWARD,
            fused_skyreels_block_forward,
            "blocks",
        ),
    )


def _kind_of(block_cls: type) -> BlockKind | None:
    fp = fingerprint(block_cls.forward)
    return next((k for k in _block_kinds() if fp in k.known), None)


def _iter_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name in ("blocks", "vace_blocks"):
        for i, block in enumerate(getattr(model, name, None) or ()):
            yield f"{name}.{i}", block


def _known(versions: dict[str, str]) -> str:
    return ", ".join(dict.fromkeys(versions.values()))


def _processor_problem(proc: Any, where: str) -> tuple[type | None, str | None]:
    """ditops' processor class for diffusers' ``proc`` (by its module and class), or why
    there is none: an unknown class, an unknown ``__call__``, or unknown q/k/v projections."""
    ours = _PROCESSORS.get((type(proc).__module__, type(proc).__name__))
    if ours is None:
        return None, (
            f"{where}.processor is a {type(proc).__name__}, not WanAttnProcessor "
            "(or a copy of it ditops knows)"
        )
    fp = fingerprint(type(proc).__call__)
    if fp not in KNOWN_ATTN_PROCESSOR:
        return None, (
            f"{where}.processor {type(proc).__qualname__}.__call__ (fingerprint {fp}) differs "
            f"from the versions ditops knows ({_known(KNOWN_ATTN_PROCESSOR)})"
        )
    fp_qkv = fingerprint(ours.qkv_projections())
    if fp_qkv not in KNOWN_QKV_PROJECTIONS:
        return None, (
            f"{type(proc).__module__}._get_qkv_projections (fingerprint {fp_qkv}) differs from "
            f"the versions ditops knows ({_known(KNOWN_QKV_PROJECTIONS)})"
        )
    return ours, None


def _check(model: nn.Module, options: PatchOptions) -> WanPlan:
    import diffusers

    norms, attention = options.norms, options.attention
    version = getattr(diffusers, "__version__", "?")
    problems: list[str] = []
    processor = norms or attention is not None  # attn1's processor is replaced
    plan = WanPlan(count_steps=True)  # counted only for calls without a step index
    if not any(True for _ in _iter_blocks(model)):
        problems.append("the model has no blocks")
    if (
        attention is not None
        and len(getattr(getattr(model, "config", None), "patch_size", ())) != 3
    ):
        problems.append("sparse attention needs the model's config.patch_size (t, h, w)")
    kinds: dict[type, BlockKind | None] = {}
    for where, block in _iter_blocks(model):
        label = "{}[{}]".format(*where.rsplit(".", 1))  # blocks[3], in messages
        cls = type(block)
        if cls not in kinds:
            kinds[cls] = _kind_of(cls)
        kind = kinds[cls]
        if kind is None:
            fp = fingerprint(cls.forward)
            problems.append(
                f"{label} is a {cls.__name__} whose forward (fingerprint {fp}) is none ditops "
                f"knows of diffusers {version} (WanTransformerBlock's, "
                "WanVACETransformerBlock's, SkyReelsV2TransformerBlock's of "
                f"{_known(KNOWN_BLOCK_FORWARD)})"
            )
            continue
        if norms:
            unfused = forward_wrapper_problem(block, label) or _norm_problem(block)
            if unfused:
                plan.unfused[where] = unfused
        table = getattr(block, "scale_shift_table", None)
        if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[1] != 6:
            problems.append(f"{label}.scale_shift_table is not a [1, 6, C] tensor")
        if processor:
            ours, problem = _processor_problem(
                getattr(block.attn1, "processor", None), f"{label}.attn1"
            )
            if problem:
                problems.append(problem)
            else:
                plan.processors[where] = ours  # type: ignore[assignment]
        if norms:
            problems += _prologue_problems(block.attn1, f"{label}.attn1")
        plan.blocks.append((where, block, kind))
    refuse(model, problems)
    return plan


def _norm_problem(block: nn.Module) -> str | None:
    """Why the fused forward cannot stand in for this block's norms (a norm of the user's,
    or of another kind), or None: such a block runs diffusers' forward."""
    for name in ("norm1", "norm3"):
        norm = getattr(block, name, None)
        if not isinstance(norm, nn.LayerNorm) or norm.elementwise_affine:
            return f"{name} is a {type(norm).__name__}, not a LayerNorm without affine parameters"
    norm2 = getattr(block, "norm2", None)
    if not isinstance(norm2, (nn.LayerNorm, nn.Identity)):
        return f"norm2 is a {type(norm2).__name__}, not a LayerNorm or Identity"
    return None


def _prologue_problems(attn: nn.Module, where: str) -> list[str]:
    """Why the fused prologue cannot stand in for this attention's norm_q / norm_k."""
    width = attn.inner_dim
    problems = []
    for name in ("norm_q", "norm_k"):
        norm = getattr(attn, name, None)
        if not isinstance(norm, nn.RMSNorm) or norm.weight is None:
            problems.append(f"{where}.{name} is not a torch.nn.RMSNorm with a weight")
        elif tuple(norm.normalized_shape) != (width,):
            problems.append(f"{where}.{name} does not normalise across the {attn.heads} heads")
    if not problems and attn.norm_q.eps != attn.norm_k.eps:
        problems.append(f"{where}.norm_q and norm_k have different eps")
    return problems


class _ModulationOps:
    """One set of fused-op instances per patched model, carrying its precision (a plain
    object: it deep-copies and pickles with the model)."""

    def __init__(self, precision: str | None) -> None:
        from ditops.layers import modulation

        self.ln_mod = modulation.LayerNormScaleShiftOp()
        self.fused = modulation.ScaleResidualLayerNormScaleShiftOp()
        self.gated = modulation.GatedResidualOp()
        for op in (self.ln_mod, self.fused, self.gated):
            op.precision = precision


def _modulations(block: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # The same arithmetic as diffusers (an fp32 sum), so exact mode stays bitwise.
    if temb.ndim == 4:  # [B, L, 6, C]: one modulation per token (Wan2.2 TI2V)
        chunks = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(c.squeeze(2) for c in chunks)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


def _fused_chain(
    block: nn.Module,
    ops: _ModulationOps,
    h: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    modulations: tuple[torch.Tensor, ...],
    rotary_emb: Any,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Wan's norm / modulation / residual chain around attn1, attn2 and ffn, fused."""
    norm2 = block.norm2
    shift, scale, gate, c_shift, c_scale, c_gate = modulations
    n = ops.ln_mod(h, None, None, scale, shift, block.norm1.eps)
    attn = block.attn1(n, None, attention_mask, rotary_emb)
    if isinstance(norm2, nn.LayerNorm):
        n, h = ops.fused(h, attn, gate, norm2.weight, norm2.bias, None, None, norm2.eps)
    else:  # cross_attn_norm=False: norm2 is Identity, so n is the new residual itself
        h = ops.gated(h, attn, gate)
        n = h
    attn = block.attn2(n, encoder_hidden_states, None, None)
    n, h = ops.fused(h, attn, 1, None, None, c_scale, c_shift, block.norm3.eps)
    ff = block.ffn(n)
    return ops.gated(h, ff, c_gate)


def fused_block_forward(
    block: nn.Module,
    ops: _ModulationOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` on the fused ops (see the module docstring).

    Installed through :func:`~ditops.integrations.base.install_guarded`: it runs only
    while nothing is attached to the norms it bypasses (:data:`BLOCK_BYPASSES`).
    """
    mods = _modulations(block, temb)
    return _fused_chain(block, ops, hidden_states, encoder_hidden_states, mods, rotary_emb)


def fused_vace_block_forward(
    block: nn.Module,
    ops: _ModulationOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    control_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``WanVACETransformerBlock.forward``: the input projection (block 0: the control
    states plus the video's), Wan's chain on the fused ops over the control states, the
    output projection (the hint). Returns ``(hint, control states)``, as diffusers."""
    control = control_hidden_states
    if block.proj_in is not None:
        control = block.proj_in(control)
        control = control + hidden_states
    mods = (block.scale_shift_table.to(temb.device) + temb.float()).chunk(6, dim=1)
    control = _fused_chain(block, ops, control, encoder_hidden_states, mods, rotary_emb)
    hint = block.proj_out(control) if block.proj_out is not None else None
    return hint, control


def fused_skyreels_block_forward(
    block: nn.Module,
    ops: _ModulationOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """``SkyReelsV2TransformerBlock.forward``: Wan's chain, with diffusion forcing's
    per-frame modulation (``temb`` ``[B, 6, L, C]``: one per token, the same fp32 sum) and
    the attention mask (causal frame blocks) handed to self-attention."""
    if temb.dim() == 3:
        mods = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    elif temb.dim() == 4:
        e = (block.scale_shift_table.unsqueeze(2) + temb.float()).chunk(6, dim=1)
        mods = tuple(ei.squeeze(1) for ei in e)
    else:
        raise ValueError(f"SkyReelsV2TransformerBlock: temb must be 3-D or 4-D, got {temb.dim()}-D")
    return _fused_chain(
        block, ops, hidden_states, encoder_hidden_states, mods, rotary_emb, attention_mask
    )


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # WanAttnProcessor's rotary embedding (interleaved pairs), the same operations.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[..., 0::2]
    s = sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


#: The q/k norms the fused prologue computes without calling them.
PROLOGUE_BYPASS = Bypass((("norm_q", nn.RMSNorm), ("norm_k", nn.RMSNorm)))


class WanSelfAttnProcessor(WrappingProcessor):
    """Wan self-attention (``attn1``) with ditops' prologue and optional block sparsity.

    ``prologue`` (a ``qk_norm_rope`` op, installed with the fused blocks): the RMSNorm of
    q and k across heads and the rotary embedding run as one op, on dense and sparse
    steps; in exact precision bitwise what ``WanAttnProcessor`` computes. ``sparse`` (a
    :class:`~ditops.layers.sparse_attention.BlockSparseAttention`): block-sparse attention on the
    sparse denoising steps. Without a prologue, dense steps run the wrapped
    ``WanAttnProcessor`` itself; any call this processor was not written for
    (cross-attention, I2V's image keys, no rotary embedding) always does. A call with an
    attention mask (SkyReels-V2's causal frame blocks) runs dense, with the mask, as
    diffusers calls it (the prologue fused): block-sparse attention takes no mask, so on
    a sparse step such a call runs dense and ditops warns once.

    One subclass per diffusers processor class it wraps (:attr:`wraps`: Wan's and the
    copies in ChronoEdit, SkyReels-V2 and Wan-Animate), so that ``type(p)()`` builds one
    wrapping the model's own processor class.

    Under diffusers' context parallelism (:mod:`ditops.integrations.parallel`): the
    config lives on the wrapped processor (``_parallel_config`` and ``_attention_backend``
    read and write through), so ``enable_parallelism`` after the patch reaches it, a patch
    after ``enable_parallelism`` (or ``from_pretrained(parallel_config=...)``) finds the
    config there, and ``unpatch`` leaves it in place. Dense attention is diffusers'
    ``dispatch_attention_fn`` with that config (its own exchange), as in the unpatched
    model. Sparse steps exchange q/k/v so that each rank estimates and attends over the
    whole sequence for its heads; with sparsity and ``ring_degree > 1`` ditops exchanges
    at every step and dense steps run diffusers' attention backend on the exchanged heads.
    """

    #: The diffusers processor this class wraps: (module, class name).
    wraps = ("diffusers.models.transformers.transformer_wan", "WanAttnProcessor")

    def __init__(
        self,
        original: Any | None = None,
        steps: StepState | None = None,
        sparse: nn.Module | None = None,
        prologue: Any | None = None,
    ) -> None:
        if sparse is not None and steps is None:
            raise ValueError(f"{type(self).__name__}: sparse attention needs the step state")
        if original is None:  # built as diffusers' loaders build processors: type(p)()
            module, name = self.wraps
            original = getattr(importlib.import_module(module), name)()
        super().__init__(original)
        self._qkv = self.qkv_projections()  # resolved once: not traced under compile
        self.steps = steps
        self.sparse = sparse
        self.prologue = prologue

    def _dense_now(self) -> bool:
        if self.sparse is None or self.steps is None:
            return True
        cfg = self.sparse.config
        step = self.steps.current()
        if step is None and cfg.skip_first_steps > 0:
            return True  # step unknown: never sparse by accident
        return bool(cfg.dense_at(step))

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cp = context_parallel_of(self._parallel_config)
        dense = self._dense_now()
        # ditops' exchange runs dense steps too when sparse steps run under Ring.
        ours = not dense or (self.sparse is not None and cp is not None and cp.ring_degree > 1)
        prologue = (
            self.prologue is not None
            and rotary_emb is not None
            and PROLOGUE_BYPASS.problem(attn) is None  # hooked or replaced norms: called
        )
        if attention_mask is not None and encoder_hidden_states is None:
            if not dense:
                _warn_once(
                    "ditops: a self-attention call with an attention mask (SkyReels-V2's "
                    "causal frame blocks) runs dense attention with the mask on sparse steps "
                    "too: block-sparse attention takes no mask"
                )
            ours = False  # diffusers' attention, with the mask, as the model calls it
        if (
            encoder_hidden_states is not None
            or getattr(attn, "add_k_proj", None) is not None
            or (not ours and not prologue)
        ):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        query, key, value = self._qkv(attn, hidden_states, None)
        query, key = self._norm_rope(attn, query, key, rotary_emb, prologue)
        value = value.unflatten(2, (attn.heads, -1))
        if not ours:  # dense, as WanAttnProcessor calls it (diffusers' exchange, if any)
            from diffusers.models.attention_dispatch import dispatch_attention_fn

            out = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        else:
            attend = self._dense if dense else self._sparse
            if cp is None:
                out = attend(query, key, value)
            else:
                out = attend_across_ranks(cp, query, key, value, attend)
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    @classmethod
    def qkv_projections(cls) -> Any:
        """``_get_qkv_projections`` of the module of the processor wrapped (its fingerprint
        is checked when patching)."""
        return importlib.import_module(cls.wraps[0])._get_qkv_projections

    def _norm_rope(
        self,
        attn: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
        prologue: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm_q``/``norm_k`` (across heads), split into heads, rotary embedding: the
        fused op when ``prologue``, else the norms called as modules (their hooks run)."""
        heads = attn.heads
        if prologue:
            assert self.prologue is not None and rotary_emb is not None
            cos, sin = rotary_emb
            return self.prologue(
                query.unflatten(2, (heads, -1)),
                key.unflatten(2, (heads, -1)),
                attn.norm_q.weight,
                attn.norm_k.weight,
                cos[..., 0::2],  # the entries WanAttnProcessor reads
                sin[..., 1::2],
                attn.norm_q.eps,
                across_heads=True,
            )
        query = attn.norm_q(query).unflatten(2, (heads, -1))
        key = attn.norm_k(key).unflatten(2, (heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary(query, *rotary_emb)
            key = _apply_rotary(key, *rotary_emb)
        return query, key

    def _sparse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Estimate + block-sparse attention over the whole sequence ([B, S, N, D])."""
        assert self.sparse is not None and self.steps is not None
        from ditops.attention.schedule import first_frame_dense_blocks

        shape = self.steps.latent_shape  # the whole video: recorded before any split
        dense = None  # passed per call, not set on the layer: threads share it
        if shape is not None:
            dense = first_frame_dense_blocks(
                shape, self.steps.patch_size, self.sparse.config.block_size
            )
        return self.sparse(
            q,
            k,
            v,
            layout="BSND",
            step=self.steps.current(),
            branch=self.steps.branch,
            dense_blocks=dense,
        )

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dense attention as WanAttnProcessor runs it on one device (its backend)."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            q, k, v, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )


class ChronoEditSelfAttnProcessor(WanSelfAttnProcessor):
    """:class:`WanSelfAttnProcessor` over ChronoEdit's copy of ``WanAttnProcessor``."""

    wraps = ("diffusers.models.transformers.transformer_chronoedit", "WanAttnProcessor")


class SkyReelsV2SelfAttnProcessor(WanSelfAttnProcessor):
    """:class:`WanSelfAttnProcessor` over ``SkyReelsV2AttnProcessor``."""

    wraps = ("diffusers.models.transformers.transformer_skyreels_v2", "SkyReelsV2AttnProcessor")


class WanAnimateSelfAttnProcessor(WanSelfAttnProcessor):
    """:class:`WanSelfAttnProcessor` over Wan-Animate's copy of ``WanAttnProcessor``."""

    wraps = ("diffusers.models.transformers.transformer_wan_animate", "WanAttnProcessor")


#: diffusers' processor (module, class name) -> ditops' processor wrapping it.
_PROCESSORS: dict[tuple[str, str], type[WanSelfAttnProcessor]] = {
    cls.wraps: cls
    for cls in (
        WanSelfAttnProcessor,
        ChronoEditSelfAttnProcessor,
        SkyReelsV2SelfAttnProcessor,
        WanAnimateSelfAttnProcessor,
    )
}

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


class WanFamily:
    """diffusers' ``WanTransformer3DModel`` and the models built of its blocks (VACE,
    SkyReels-V2, ChronoEdit, Wan-Animate): fused blocks, optional sparse self-attention."""

    name = "wan"

    def recognise(self, model: nn.Module) -> bool:
        """One of :data:`MODEL_CLASSES`, or a model whose first block's forward is one
        ditops knows (a copy under another name); :meth:`check` then fingerprints all."""
        if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
            return False
        if type(model).__name__ in MODEL_CLASSES:
            return True
        first = next(iter(model.blocks), None)  # type: ignore[arg-type]
        return first is not None and _kind_of(type(first)) is not None

    def check(self, model: nn.Module, options: PatchOptions) -> WanPlan:
        """Everything the patch relies on, checked before any change. Raises PatchError."""
        return _check(model, options)

    def apply(
        self, model: nn.Module, plan: WanPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch a checked Wan model in place, recording every change on ``record``."""
        if options.norms:
            swap_norms(model, record, options.precision)
            ops = _ModulationOps(options.precision)
            for where, block, kind in plan.blocks:
                if where in plan.unfused:
                    record.count(f"unfused {kind.kind}")
                    record.unfused[where] = plan.unfused[where]
                    continue
                install_guarded(block, kind.fused, ops, BLOCK_BYPASSES, record, where, kind.kind)
        if options.norms or options.attention is not None:
            self._attention(model, plan, record, options)

    def _attention(
        self, model: nn.Module, plan: WanPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Self-attention: the fused prologue with the fused blocks, sparsity if asked."""
        steps = None
        if options.attention is not None:
            steps = StepState(count_steps=plan.count_steps)
            steps.patch_size = tuple(model.config.patch_size)  # type: ignore[attr-defined]
            track_steps(model, steps, record)
        for cls in set(plan.processors.values()):
            module, name = cls.wraps
            register_like(cls, getattr(importlib.import_module(module), name))
        for where, block, _kind in plan.blocks:
            sparse = prologue = None
            if options.attention is not None:
                from ditops.layers.sparse_attention import BlockSparseAttention

                sparse = BlockSparseAttention(options.attention)
                record.count("sparse self-attentions")
            if options.norms:
                from ditops.layers.qk_norm_rope import QKNormRopeOp

                prologue = QKNormRopeOp()
                prologue.precision = options.precision
                record.count("fused attention prologues")
            processor = plan.processors[where](block.attn1.processor, steps, sparse, prologue)
            record.add(AttrSet.apply(block.attn1, "processor", processor))
