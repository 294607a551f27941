"""Patching diffusers' ``FluxTransformer2DModel`` (FLUX.1 and models built like it).

FLUX has two kinds of blocks, both around adaLN-Zero in the model dtype (diffusers 0.42):

* ``FluxTransformerBlock`` (double-stream: image and text tokens with their own weights,
  joint attention)::

      n, gate, ... = norm1(h, temb)           # LN(h) * (1 + scale) + shift, model dtype
      c_n, c_gate, ... = norm1_context(c, temb)
      a, c_a = attn(n, c_n, rope)             # q/k RMSNorm per head, rotary, attention
      h = h + gate * a;  n = norm2(h) * (1 + scale_mlp) + shift_mlp
      h = h + gate_mlp * ff(n)
      c = c + c_gate * c_a;  c_n = norm2_context(c) * (1 + ...) + ...
      c = c + c_gate_mlp * ff_context(c_n);  fp16: c = c.clip(-65504, 65504)

* ``FluxSingleTransformerBlock`` (single-stream over ``cat([text, image])``)::

      n, gate = norm(h, temb);  a = attn(n, rope);  m = act(proj_mlp(n))
      h = h + gate * proj_out(cat([a, m]));  fp16: clip

and the output norm ``norm_out`` (``AdaLayerNormContinuous``) is ``LN(h) * (1 + scale) +
shift`` again. The patched model runs the same expressions on ditops' ops, in FLUX's own
arithmetic: the modulated norms on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate`, each gated residual followed by
a modulated norm on the fused
:func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate`, the last residual of
each stream on :func:`~ditops.ops.modulation_model_dtype.adaln_residual`; the fp16 clip
where FLUX has it. Attention runs
:class:`~ditops.integrations.flux.forwards.FusedFluxAttnProcessor`, which is
``FluxAttnProcessor`` with the prologue (RMSNorm of q and k per head, then the rotary
embedding) on the fused
:func:`~ditops.ops.qk_norm_rope.qk_norm_rope`: one call for the single-stream blocks;
for the double-stream blocks one for the text tokens (``norm_added_q``/``norm_added_k``,
the first rows of the tables) and one for the image tokens, concatenated as FLUX does.
In exact precision the patched model is bitwise the unpatched one.

Before changing anything, :meth:`FluxFamily.check` compares the blocks, norms and
processors against what this module was written for, and the source of every diffusers
function whose arithmetic it reproduces against the fingerprints of the versions it was
checked with: a model that does not match is refused whole, with the reasons. Attention
processors other than ``FluxAttnProcessor`` (IP-Adapter's, one of your own) are kept as
they are (the blocks around them are still fused). Forwards wrapped by diffusers or
accelerate hooks are patched under the hooks.

This module checks a model and applies the patch; the fused forwards and the attention
processor are in :mod:`ditops.integrations.flux.forwards`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ditops.integrations.flux.forwards import (
    DOUBLE_BYPASSES,
    NORM_OUT_BYPASSES,
    SINGLE_BYPASSES,
    FluxOps,
    FusedFluxAttnProcessor,
    double_block_forward,
    norm_out_forward,
    single_block_forward,
)
from ditops.integrations.shared.adaln_zero import DIFFUSERS_042, relied_on_norms
from ditops.integrations.shared.base import (
    AttrSet,
    PatchError,
    PatchOptions,
    PatchRecord,
    fingerprint_problems,
    is_plain_layer_norm,
    refuse,
    register_like,
)
from ditops.integrations.shared.guard import forward_wrapper_problem, install_guarded


def _relied_on() -> dict[str, tuple[Callable[..., Any], dict[str, str]]]:
    """Every diffusers function whose arithmetic the patch reproduces, with the
    fingerprints (:func:`~ditops.integrations.shared.base.fingerprint`) of the versions this
    module was checked against."""
    from diffusers.models import embeddings
    from diffusers.models.transformers import transformer_flux as tf

    return {
        "FluxTransformerBlock.forward": (
            tf.FluxTransformerBlock.forward, {"89e3052fb2a6327e": DIFFUSERS_042}
        ),
        "FluxSingleTransformerBlock.forward": (
            tf.FluxSingleTransformerBlock.forward, {"bdc8d269208a5dcc": DIFFUSERS_042}
        ),
        "FluxAttnProcessor.__call__": (
            tf.FluxAttnProcessor.__call__, {"80975ab2f153f684": DIFFUSERS_042}
        ),
        **relied_on_norms(),
        "apply_rotary_emb": (embeddings.apply_rotary_emb, {"189bf9067f37ce92": DIFFUSERS_042}),
    }  # fmt: skip


# --- check and apply ---------------------------------------------------------------------------


@dataclass
class FluxPlan:
    """What :meth:`FluxFamily.apply` changes (all checked)."""

    double: list[nn.Module] = field(default_factory=list)
    single: list[nn.Module] = field(default_factory=list)
    attentions: list[nn.Module] = field(default_factory=list)  # processors to fuse
    kept: list[str] = field(default_factory=list)  # processors left as they are
    norm_out: nn.Module | None = None
    #: "transformer_blocks.3" -> why that forward runs diffusers' own (not fused).
    unfused: dict[str, str] = field(default_factory=dict)


def _qk_norm_problems(attn: nn.Module, where: str) -> list[str]:
    """The q/k norms of a fused prologue: torch RMSNorms over the head dim, q's and k's of
    one eps and one weight dtype (the op takes one of each per call)."""
    pairs = [("norm_q", "norm_k")]
    if getattr(attn, "added_kv_proj_dim", None) is not None:
        pairs.append(("norm_added_q", "norm_added_k"))
    problems = []
    for qn, kn in pairs:
        q, k = getattr(attn, qn, None), getattr(attn, kn, None)
        if type(q) is not nn.RMSNorm or type(k) is not nn.RMSNorm:
            problems.append(f"{where}.{qn}/{kn} are not torch.nn.RMSNorm")
            continue
        if tuple(q.normalized_shape) != (attn.head_dim,) or tuple(k.normalized_shape) != (
            attn.head_dim,
        ):
            problems.append(f"{where}.{qn}/{kn} do not normalise over the head dim")
        if q.eps != k.eps:
            problems.append(f"{where}.{qn} and {kn} have different eps ({q.eps}, {k.eps})")
        qw, kw = q.weight, k.weight
        if (qw is None) != (kw is None) or (qw is not None and qw.dtype != kw.dtype):
            problems.append(f"{where}.{qn} and {kn} differ in weight (one None, or dtypes)")
    return problems


def _double_norm_problem(block: nn.Module) -> str | None:
    """Why a double-stream block's norms are not what the fused forward computes (a norm
    of the user's, or of another kind), or None: such a block runs diffusers' forward."""
    from diffusers.models import normalization

    for name in ("norm1", "norm1_context"):
        norm = getattr(block, name, None)
        if (
            type(norm) is not normalization.AdaLayerNormZero
            or norm.emb is not None
            or not is_plain_layer_norm(norm.norm)
        ):
            return f"{name} is not an AdaLayerNormZero over a LayerNorm without affine"
    for name in ("norm2", "norm2_context"):
        norm = getattr(block, name, None)
        if not is_plain_layer_norm(norm):
            return f"{name} is a {type(norm).__name__}, not a LayerNorm without affine parameters"
    return None


def _check(model: nn.Module, options: PatchOptions) -> FluxPlan:
    from diffusers.models import normalization
    from diffusers.models.transformers import transformer_flux as tf

    problems: list[str] = []
    if options.attention is not None:
        raise PatchError(
            "sparse attention is supported for WanTransformer3DModel (and VACE, SkyReels-V2, "
            "ChronoEdit, Wan-Animate) and "
            "HunyuanVideo(15)Transformer3DModel, not for "
            f"{type(model).__name__}; call patch(..., attention=None) to patch its blocks only"
        )
    plan = FluxPlan()
    if not options.norms:
        return plan
    problems += fingerprint_problems(_relied_on())

    def check_attention(block: nn.Module, where: str) -> None:
        attn = getattr(block, "attn", None)
        proc = getattr(attn, "processor", None)
        if type(proc) is not tf.FluxAttnProcessor:
            plan.kept.append(f"{where}.attn: {type(proc).__name__}")
            return
        found = _qk_norm_problems(attn, f"{where}.attn")  # type: ignore[arg-type]
        problems.extend(found)
        if not found:
            plan.attentions.append(attn)  # type: ignore[arg-type]

    for i, block in enumerate(getattr(model, "transformer_blocks", [])):
        where = f"transformer_blocks[{i}]"
        if type(block) is not tf.FluxTransformerBlock:
            problems.append(f"{where} is a {type(block).__name__}, not FluxTransformerBlock")
            continue
        unfused = forward_wrapper_problem(block, where) or _double_norm_problem(block)
        if unfused:
            plan.unfused[f"transformer_blocks.{i}"] = unfused
        check_attention(block, where)
        plan.double.append(block)
    for i, block in enumerate(getattr(model, "single_transformer_blocks", [])):
        where = f"single_transformer_blocks[{i}]"
        if type(block) is not tf.FluxSingleTransformerBlock:
            problems.append(f"{where} is a {type(block).__name__}, not FluxSingleTransformerBlock")
            continue
        norm = getattr(block, "norm", None)
        unfused = forward_wrapper_problem(block, where)
        if type(norm) is not normalization.AdaLayerNormZeroSingle or not is_plain_layer_norm(
            norm.norm
        ):
            unfused = "norm is not an AdaLayerNormZeroSingle over a LayerNorm without affine"
        if unfused:
            plan.unfused[f"single_transformer_blocks.{i}"] = unfused
        check_attention(block, where)
        plan.single.append(block)
    norm_out = getattr(model, "norm_out", None)
    if type(norm_out) is not normalization.AdaLayerNormContinuous or not is_plain_layer_norm(
        norm_out.norm
    ):
        problems.append("norm_out is not an AdaLayerNormContinuous over a LayerNorm without affine")
    else:
        wrapped = forward_wrapper_problem(norm_out, "norm_out")
        if wrapped:
            plan.unfused["norm_out"] = wrapped
        plan.norm_out = norm_out
    refuse(model, problems)
    return plan


class FluxFamily:
    """diffusers' ``FluxTransformer2DModel``: fused adaLN chain and attention prologue."""

    name = "flux"
    model_classes = ("FluxTransformer2DModel",)
    sparse_attention = False

    def recognise(self, model: nn.Module) -> bool:
        return type(model).__name__ in self.model_classes and hasattr(
            model, "single_transformer_blocks"
        )

    def check(self, model: nn.Module, options: PatchOptions) -> FluxPlan:
        """Everything the patch relies on, checked before any change. Raises PatchError."""
        return _check(model, options)

    def apply(
        self, model: nn.Module, plan: FluxPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch a checked FLUX model in place, recording every change on ``record``."""
        if not options.norms:
            return
        ops = FluxOps(options.precision)
        kinds = (
            ("transformer_blocks", plan.double, double_block_forward, DOUBLE_BYPASSES),
            ("single_transformer_blocks", plan.single, single_block_forward, SINGLE_BYPASSES),
        )
        for prefix, blocks, fused, bypassed in kinds:
            for i, block in enumerate(blocks):
                where = f"{prefix}.{i}"
                if where in plan.unfused:
                    record.count("unfused blocks")
                    record.unfused[where] = plan.unfused[where]
                else:
                    install_guarded(block, fused, ops, bypassed, record, where)
        from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

        register_like(FusedFluxAttnProcessor, FluxAttnProcessor)
        for attn in plan.attentions:
            processor = FusedFluxAttnProcessor(attn.processor, ops)
            record.add(AttrSet.apply(attn, "processor", processor))
        record.count("fused attention prologues", len(plan.attentions))
        if plan.kept:
            record.count("attention processors kept", len(plan.kept))
        if plan.norm_out is not None and "norm_out" in plan.unfused:
            record.count("unfused output norm")
            record.unfused["norm_out"] = plan.unfused["norm_out"]
        elif plan.norm_out is not None:
            norm = plan.norm_out
            install_guarded(
                norm, norm_out_forward, ops, NORM_OUT_BYPASSES, record, "norm_out", "output norm"
            )
