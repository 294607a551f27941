"""Patching diffusers' ``WanTransformer3DModel`` (Wan2.1, Wan2.2 A14B / TI2V, I2V).

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
:class:`~ditops.layers.attention.BlockSparseAttention` runs on the sparse steps.

Before changing anything, :meth:`WanFamily.check` compares every block and processor
against what this module was written for (types, sub-modules and a fingerprint of the
source of ``WanTransformerBlock.forward`` and ``WanAttnProcessor.__call__``): a model that
does not match is refused whole, with the reason. Blocks already wrapped by diffusers or
accelerate hooks (caching, offloading, context parallelism) are patched under the hooks.
"""

from __future__ import annotations

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
    ditops_forward,
    fingerprint,
    forward_wrapper_problem,
    install_guarded,
    refuse,
    register_like,
)
from ditops.integrations.norms import swap_norms
from ditops.integrations.parallel import attend_across_ranks, context_parallel_of
from ditops.integrations.steps import StepState, track_steps

# base.fingerprint of the diffusers versions this module was checked against.
KNOWN_BLOCK_FORWARD = {"318f5cac859c98ee": "diffusers 0.42"}
KNOWN_ATTN_PROCESSOR = {"860a708317404b68": "diffusers 0.42"}


@dataclass
class WanPlan:
    blocks: list[nn.Module]  # the blocks whose self-attention processor is ditops'
    #: blocks[i] -> why its forward cannot be fused (it runs diffusers' forward).
    unfused: dict[int, str] = field(default_factory=dict)


#: What the fused block computes without calling it (see :class:`~.base.Bypass`).
BLOCK_BYPASSES = ("norm1", "norm2", "norm3")


def _iter_blocks(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    yield from enumerate(model.blocks)  # type: ignore[arg-type]


def _check(model: nn.Module, options: PatchOptions) -> WanPlan:
    import diffusers
    from diffusers.models.transformers import transformer_wan

    norms, attention = options.norms, options.attention
    version = getattr(diffusers, "__version__", "?")
    problems: list[str] = []
    block_cls = transformer_wan.WanTransformerBlock
    fp = fingerprint(block_cls.forward)
    if norms and fp not in KNOWN_BLOCK_FORWARD:
        problems.append(
            f"WanTransformerBlock.forward of diffusers {version} (fingerprint {fp}) differs "
            f"from the versions ditops knows ({', '.join(KNOWN_BLOCK_FORWARD.values())})"
        )
    processor = norms or attention is not None  # attn1's processor is replaced
    if processor:
        fp_attn = fingerprint(transformer_wan.WanAttnProcessor.__call__)
        if fp_attn not in KNOWN_ATTN_PROCESSOR:
            problems.append(
                f"WanAttnProcessor of diffusers {version} (fingerprint {fp_attn}) differs from "
                f"the versions ditops knows ({', '.join(KNOWN_ATTN_PROCESSOR.values())})"
            )
    plan = WanPlan([])
    for i, block in _iter_blocks(model):
        where = f"blocks[{i}]"
        if type(block) is not block_cls:
            problems.append(
                f"{where} is a {type(block).__name__}, not diffusers' WanTransformerBlock"
            )
            continue
        if norms:
            unfused = forward_wrapper_problem(block, where) or _norm_problem(block)
            if unfused:
                plan.unfused[i] = unfused
        table = getattr(block, "scale_shift_table", None)
        if not isinstance(table, torch.Tensor) or table.dim() != 3 or table.shape[1] != 6:
            problems.append(f"{where}.scale_shift_table is not a [1, 6, C] tensor")
        if processor:
            proc = getattr(block.attn1, "processor", None)
            if type(proc) is not transformer_wan.WanAttnProcessor:
                problems.append(
                    f"{where}.attn1.processor is a {type(proc).__name__}, not WanAttnProcessor"
                )
        if norms:
            problems += _prologue_problems(block.attn1, f"{where}.attn1")
        plan.blocks.append(block)
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


@ditops_forward
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
    norm2 = block.norm2
    shift, scale, gate, c_shift, c_scale, c_gate = _modulations(block, temb)
    h = hidden_states
    n = ops.ln_mod(h, None, None, scale, shift, block.norm1.eps)
    attn = block.attn1(n, None, None, rotary_emb)
    if isinstance(norm2, nn.LayerNorm):
        n, h = ops.fused(h, attn, gate, norm2.weight, norm2.bias, None, None, norm2.eps)
    else:  # cross_attn_norm=False: norm2 is Identity, so n is the new residual itself
        h = ops.gated(h, attn, gate)
        n = h
    attn = block.attn2(n, encoder_hidden_states, None, None)
    n, h = ops.fused(h, attn, 1, None, None, c_scale, c_shift, block.norm3.eps)
    ff = block.ffn(n)
    return ops.gated(h, ff, c_gate)


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
    :class:`~ditops.layers.attention.BlockSparseAttention`): block-sparse attention on the
    sparse denoising steps. Without a prologue, dense steps run the wrapped
    ``WanAttnProcessor`` itself; any call this processor was not written for
    (cross-attention, a mask, I2V's image keys, no rotary embedding) always does.

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

    def __init__(
        self,
        original: Any | None = None,
        steps: StepState | None = None,
        sparse: nn.Module | None = None,
        prologue: Any | None = None,
    ) -> None:
        if sparse is not None and steps is None:
            raise ValueError("WanSelfAttnProcessor: sparse attention needs the step state")
        if original is None:  # built as diffusers' loaders build processors: type(p)()
            from diffusers.models.transformers.transformer_wan import WanAttnProcessor

            original = WanAttnProcessor()
        super().__init__(original)
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
        if (
            encoder_hidden_states is not None
            or attention_mask is not None
            or getattr(attn, "add_k_proj", None) is not None
            or (not ours and not prologue)
        ):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb
            )
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = self._norm_rope(attn, query, key, rotary_emb, prologue)
        value = value.unflatten(2, (attn.heads, -1))
        if not ours:  # dense, as WanAttnProcessor calls it (diffusers' exchange, if any)
            from diffusers.models.attention_dispatch import dispatch_attention_fn

            out = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=None,
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


class WanFamily:
    """diffusers' ``WanTransformer3DModel``: fused blocks, optional sparse self-attention."""

    name = "wan"

    def recognise(self, model: nn.Module) -> bool:
        return type(model).__name__ == "WanTransformer3DModel" and hasattr(model, "blocks")

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
            for i, block in enumerate(plan.blocks):
                if i in plan.unfused:
                    record.count("unfused blocks")
                    record.unfused[f"blocks.{i}"] = plan.unfused[i]
                    continue
                install_guarded(
                    block, fused_block_forward, ops, BLOCK_BYPASSES, record, f"blocks.{i}"
                )
        if options.norms or options.attention is not None:
            self._attention(model, plan, record, options)

    def _attention(
        self, model: nn.Module, plan: WanPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Self-attention: the fused prologue with the fused blocks, sparsity if asked."""
        steps = None
        if options.attention is not None:
            steps = StepState()
            steps.patch_size = tuple(model.config.patch_size)  # type: ignore[attr-defined]
            track_steps(model, steps, record)
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor

        register_like(WanSelfAttnProcessor, WanAttnProcessor)
        for block in plan.blocks:
            sparse = prologue = None
            if options.attention is not None:
                from ditops.layers.attention import BlockSparseAttention

                sparse = BlockSparseAttention(options.attention)
                record.count("sparse self-attentions")
            if options.norms:
                from ditops.layers.qk_norm_rope import QKNormRopeOp

                prologue = QKNormRopeOp()
                prologue.precision = options.precision
                record.count("fused attention prologues")
            processor = WanSelfAttnProcessor(block.attn1.processor, steps, sparse, prologue)
            record.add(AttrSet.apply(block.attn1, "processor", processor))
