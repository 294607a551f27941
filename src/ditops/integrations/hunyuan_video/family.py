"""Patching diffusers' ``HunyuanVideoTransformer3DModel`` (HunyuanVideo T2V and I2V).

Its blocks are FLUX's adaLN-Zero chain in the model dtype, with the text tokens *last*
(diffusers 0.42):

* ``HunyuanVideoTransformerBlock`` (double-stream)::

      n, gate, shift_mlp, scale_mlp, gate_mlp = norm1(h, temb)   # LN(h) * (1 + s) + sh
      c_n, c_gate, ... = norm1_context(c, temb)
      a, c_a = attn(n, c_n, mask, rope)
      h = h + a * gate;  n = norm2(h) * (1 + scale_mlp) + shift_mlp
      h = h + gate_mlp * ff(n)             # and the same for the text stream c

* ``HunyuanVideoSingleTransformerBlock`` (single-stream over ``cat([video, text])``)::

      n, gate = norm(x, temb);  m = act(proj_mlp(n))
      a, c_a = attn(n[:, :-T], n[:, -T:], mask, rope)
      x = gate * proj_out(cat([cat([a, c_a]), m], dim=2)) + x

* ``norm_out`` (``AdaLayerNormContinuous``): ``LN(h) * (1 + scale) + shift``.

The patched blocks run the same expressions on
:func:`~ditops.ops.modulation_model_dtype.adaln_modulate`,
:func:`~ditops.ops.modulation_model_dtype.adaln_residual_modulate` and
:func:`~ditops.ops.modulation_model_dtype.adaln_residual` (``h + a * g`` and ``g * a + h``
are the same bits: products and sums commute), and the attention on
:class:`~ditops.integrations.hunyuan_video.attention.HunyuanVideoAttnProcessor` (the q/k
prologue on ``qk_norm_rope`` / ``rms_norm``; block-sparse video attention when asked).
In exact precision the patched model is bitwise the unpatched one.

The I2V ``token_replace`` blocks (two modulations split at the first frame) run the same
ops on the two row ranges (:mod:`~ditops.integrations.hunyuan_video.token_replace`). Left as
diffusers runs them: the token refiner (``context_embedder``: its ``nn.LayerNorm`` has
affine parameters, which no adaLN op means) and the embeddings. Which forward a block
runs is decided in one place, :func:`fused_forward_of`.

Before changing anything, :meth:`HunyuanVideoFamily.check` compares the blocks, norms and
processors against what this module was written for, and the source of every diffusers
function whose arithmetic it reproduces against the fingerprints of the versions it was
checked with: a model that does not match is refused whole, with the reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ditops.integrations.hunyuan_video import token_replace
from ditops.integrations.hunyuan_video.attention import (
    HunyuanOps,
    HunyuanVideo15AttnProcessor,
    HunyuanVideoAttnProcessor,
    attention_problems,
    single_stream_branches,
)
from ditops.integrations.shared.adaln_zero import (
    DIFFUSERS_042,
    ada_modulate,
    adaln_ops,
    mlp_half,
    norm_out_forward,
    relied_on_norms,
)
from ditops.integrations.shared.base import (
    AttrSet,
    PatchOptions,
    PatchRecord,
    fingerprint_problems,
    is_plain_layer_norm,
    refuse,
)
from ditops.integrations.shared.guard import forward_wrapper_problem, install_guarded
from ditops.integrations.shared.steps import StepState, track_steps


def relied_on() -> dict[str, tuple[Callable[..., Any], dict[str, str]]]:
    """Every diffusers function whose arithmetic the patch reproduces, with the
    fingerprints (:func:`~ditops.integrations.shared.base.fingerprint`) of the versions this
    module was checked against. ``hunyuan_video15`` relies on some of them too."""
    from diffusers.models import embeddings, normalization
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    return {
        "HunyuanVideoTransformerBlock.forward": (
            hv.HunyuanVideoTransformerBlock.forward, {"2905bc608785d8af": DIFFUSERS_042}
        ),
        "HunyuanVideoSingleTransformerBlock.forward": (
            hv.HunyuanVideoSingleTransformerBlock.forward, {"497dbbffbea40b6e": DIFFUSERS_042}
        ),
        "HunyuanVideoAttnProcessor2_0.__call__": (
            hv.HunyuanVideoAttnProcessor2_0.__call__, {"14051151be5ee86a": DIFFUSERS_042}
        ),
        **relied_on_norms(),
        "RMSNorm.forward": (normalization.RMSNorm.forward, {"d525bc168c12c1ac": DIFFUSERS_042}),
        "apply_rotary_emb": (embeddings.apply_rotary_emb, {"189bf9067f37ce92": DIFFUSERS_042}),
        **token_replace.relied_on(),
    }  # fmt: skip


# --- the fused forwards -------------------------------------------------------------------------


def double_block_forward(
    block: nn.Module,
    ops: HunyuanOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoTransformerBlock.forward`` on ditops' ops (see the module docstring).

    Installed through :func:`~ditops.integrations.shared.guard.install_guarded`; a deep copy of
    the block gets a partial bound to the copy and its own ops. Like diffusers', it
    ignores the token-replace arguments the model passes every block.
    """
    n, emb = ada_modulate(ops, block.norm1, hidden_states, temb, 6)
    c_n, c_emb = ada_modulate(ops, block.norm1_context, encoder_hidden_states, temb, 6)
    attn_output, context_attn_output = block.attn(
        hidden_states=n,
        encoder_hidden_states=c_n,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )
    hidden_states = mlp_half(ops, hidden_states, attn_output, emb, block.norm2, block.ff)
    encoder_hidden_states = mlp_half(
        ops, encoder_hidden_states, context_attn_output, c_emb, block.norm2_context,
        block.ff_context,
    )  # fmt: skip
    return hidden_states, encoder_hidden_states


def single_block_forward(
    block: nn.Module,
    ops: HunyuanOps,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``HunyuanVideoSingleTransformerBlock.forward`` on ditops' ops (module docstring)."""
    text = encoder_hidden_states.shape[1]
    residual = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    n, (_, _, gate) = ada_modulate(ops, block.norm, residual, temb, 3)
    out = single_stream_branches(block, n, text, attention_mask, image_rotary_emb)
    hidden_states = ops.residual(residual, out, gate.unsqueeze(1))
    return hidden_states[:, :-text], hidden_states[:, -text:]


#: The sub-modules each fused forward does not call (it reads their parameters or runs
#: their arithmetic itself): hooks on them would be skipped.
_BYPASSED: dict[Callable[..., Any], tuple[str, ...]] = {
    double_block_forward: ("norm1", "norm1.norm", "norm1_context", "norm1_context.norm",
                           "norm2", "norm2_context"),
    single_block_forward: ("norm", "norm.norm"),
    **token_replace.BYPASSED,
}  # fmt: skip


def _fused_classes() -> dict[type, Callable[..., Any]]:
    """Block classes whose forward is :func:`double_block_forward` or
    :func:`single_block_forward` (HunyuanVideo-1.5's block is the same code: the
    fingerprints in :func:`relied_on` and ``hunyuan_video15`` say so)."""
    from diffusers.models.transformers import transformer_hunyuan_video as hv
    from diffusers.models.transformers import transformer_hunyuan_video15 as hv15

    return {
        hv.HunyuanVideoTransformerBlock: double_block_forward,
        hv.HunyuanVideoSingleTransformerBlock: single_block_forward,
        hv.HunyuanVideoTokenReplaceTransformerBlock: token_replace.token_replace_double_forward,
        hv.HunyuanVideoTokenReplaceSingleTransformerBlock: (
            token_replace.token_replace_single_forward
        ),
        hv15.HunyuanVideo15TransformerBlock: double_block_forward,
    }


def fused_forward_of(block: nn.Module) -> Callable[..., Any] | None:
    """The fused forward of a block's class (a function of ``(block, ops, *args)``), or
    None: diffusers' own. Installed through :func:`~.guard.install_guarded`, it runs only
    while nothing is attached to the sub-modules it bypasses (:data:`_BYPASSED`)."""
    return _fused_classes().get(type(block))


# --- check and apply ---------------------------------------------------------------------------


@dataclass
class HunyuanVideoPlan:
    """What :meth:`HunyuanVideoFamily.apply` changes (all checked)."""

    fused: list[tuple[str, nn.Module, Callable[..., Any]]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # blocks running diffusers' forward
    attentions: list[nn.Module] = field(default_factory=list)
    norm_out: nn.Module | None = None


def _block_problems(block: nn.Module, where: str, double: bool) -> list[str]:
    from diffusers.models import normalization

    problems = []
    if double:
        for name in ("norm1", "norm1_context"):
            norm = getattr(block, name, None)
            if (
                type(norm) is not normalization.AdaLayerNormZero
                or norm.emb is not None
                or not is_plain_layer_norm(norm.norm)
            ):
                problems.append(
                    f"{where}.{name} is not an AdaLayerNormZero over a LayerNorm without affine"
                )
        for name in ("norm2", "norm2_context"):
            if not is_plain_layer_norm(getattr(block, name, None)):
                problems.append(f"{where}.{name} is not a LayerNorm without affine parameters")
    else:
        norm = getattr(block, "norm", None)
        if type(norm) is not normalization.AdaLayerNormZeroSingle or not is_plain_layer_norm(
            norm.norm
        ):
            problems.append(
                f"{where}.norm is not an AdaLayerNormZeroSingle over a LayerNorm without affine"
            )
    wrapped = forward_wrapper_problem(block, where)
    return problems + ([wrapped] if wrapped else [])


@dataclass(frozen=True)
class Spec:
    """What one model of the family is made of, for :func:`check_model`."""

    #: attribute -> the block classes it may hold (every one has a fused forward)
    blocks: dict[str, tuple[type, ...]]
    processor: type  # diffusers' attention processor the blocks must have
    relied_on: Callable[[], dict[str, tuple[Callable[..., Any], dict[str, str]]]]


def _spec() -> Spec:
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    return Spec(
        blocks={
            "transformer_blocks": (
                hv.HunyuanVideoTransformerBlock, hv.HunyuanVideoTokenReplaceTransformerBlock
            ),
            "single_transformer_blocks": (
                hv.HunyuanVideoSingleTransformerBlock,
                hv.HunyuanVideoTokenReplaceSingleTransformerBlock,
            ),
        },
        processor=hv.HunyuanVideoAttnProcessor2_0,
        relied_on=lambda: relied_on(),
    )  # fmt: skip


def check_model(model: nn.Module, options: PatchOptions, spec: Spec) -> HunyuanVideoPlan:
    """Everything the patch of ``model`` relies on, checked before any change."""
    from diffusers.models import normalization

    plan = HunyuanVideoPlan()
    if not options.norms and options.attention is None:
        return plan
    problems: list[str] = []
    problems += fingerprint_problems(spec.relied_on())
    for attr, classes in spec.blocks.items():
        double = attr == "transformer_blocks"
        for i, block in enumerate(getattr(model, attr, [])):
            where = f"{attr}[{i}]"
            if type(block) not in classes:
                names = " or ".join(c.__name__ for c in classes)
                problems.append(f"{where} is a {type(block).__name__}, not {names}")
                continue
            found = attention_problems(block, where, double, spec.processor)
            if type(block).__name__.startswith("HunyuanVideoTokenReplace"):
                found += token_replace.norm_problems(block, where, double)
                found += [w for w in [forward_wrapper_problem(block, where)] if w]
            else:
                found += _block_problems(block, where, double)
            problems += found
            if found:
                continue
            plan.attentions.append(block.attn)
            fused = fused_forward_of(block) if options.norms else None
            if fused is not None:
                plan.fused.append((f"{attr}.{i}", block, fused))
            elif options.norms:
                plan.kept.append(where)
    norm_out = getattr(model, "norm_out", None)
    if options.norms:
        if type(norm_out) is not normalization.AdaLayerNormContinuous or not is_plain_layer_norm(
            norm_out.norm
        ):
            problems.append(
                "norm_out is not an AdaLayerNormContinuous over a LayerNorm without affine"
            )
        else:
            wrapped = forward_wrapper_problem(norm_out, "norm_out")
            problems += [wrapped] if wrapped else []
            plan.norm_out = norm_out
    refuse(model, problems)
    return plan


def apply_plan(
    model: nn.Module,
    plan: HunyuanVideoPlan,
    record: PatchRecord,
    options: PatchOptions,
    text_mask: bool = False,
) -> None:
    """Patch a checked model in place, recording every change on ``record``
    (``text_mask``: see :class:`HunyuanVideoAttnProcessor`)."""
    ops = adaln_ops(options.precision) if options.norms else None
    if ops is not None:
        for where, block, forward in plan.fused:
            install_guarded(block, forward, ops, _BYPASSED[forward], record, where)
        if plan.kept:
            record.count("blocks kept", len(plan.kept))
        if plan.norm_out is not None:
            norm = plan.norm_out
            install_guarded(
                norm, norm_out_forward, ops, ("norm",), record, "norm_out", "output norm"
            )
    steps = None
    if options.attention is not None:
        steps = StepState(count_steps=True)
        config = model.config  # type: ignore[attr-defined]
        steps.patch_size = (config.patch_size_t, config.patch_size, config.patch_size)
        track_steps(model, steps, record)
    for attn in plan.attentions:
        prologue = ops  # used per call while its q/k norms carry no hooks
        sparse = None
        if options.attention is not None:
            from ditops.layers.sparse_attention import BlockSparseAttention

            sparse = BlockSparseAttention(options.attention)
            record.count("sparse self-attentions")
        if prologue is None and sparse is None:
            continue
        cls = HunyuanVideo15AttnProcessor if text_mask else HunyuanVideoAttnProcessor
        processor = cls(attn.processor, prologue, steps, sparse)
        record.add(AttrSet.apply(attn, "processor", processor))
        if prologue is not None:
            record.count("fused attention prologues")


class HunyuanVideoFamily:
    """diffusers' ``HunyuanVideoTransformer3DModel``: fused adaLN chain and attention
    prologue, optional block-sparse video self-attention. HunyuanVideo-1.5's family is this
    one with its own model class, spec and text mask (``hunyuan_video15``)."""

    name = "hunyuan_video"
    #: the model's class name, and a block list only that model holds
    model_classes: tuple[str, ...] = ("HunyuanVideoTransformer3DModel",)
    blocks_attr = "single_transformer_blocks"
    #: the processors' mask (see :class:`HunyuanVideoAttnProcessor`)
    text_mask = False
    sparse_attention = True

    @staticmethod
    def spec() -> Spec:
        return _spec()

    def recognise(self, model: nn.Module) -> bool:
        return type(model).__name__ in self.model_classes and hasattr(model, self.blocks_attr)

    def check(self, model: nn.Module, options: PatchOptions) -> HunyuanVideoPlan:
        """Everything the patch relies on, checked before any change. Raises PatchError."""
        return check_model(model, options, self.spec())

    def apply(
        self, model: nn.Module, plan: HunyuanVideoPlan, record: PatchRecord, options: PatchOptions
    ) -> None:
        """Patch a checked model of the family in place, recording every change on ``record``."""
        apply_plan(model, plan, record, options, text_mask=self.text_mask)
