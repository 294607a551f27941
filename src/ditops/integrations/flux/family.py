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

Before changing anything, the skeleton's check (:mod:`~ditops.integrations.shared.family`)
compares the blocks, norms and processors against what this module was written for,
and the source of every diffusers function whose arithmetic it reproduces against the
fingerprints of the versions it was checked with: a model that does not match is
refused whole, with the reasons. Attention processors other than ``FluxAttnProcessor``
(IP-Adapter's, one of your own) are kept as they are (the blocks around them are still
fused). Forwards wrapped by diffusers or
accelerate hooks are patched under the hooks.

This module declares the family (:data:`SPEC`); the fused forwards and the attention
processor are in :mod:`ditops.integrations.flux.forwards`.
"""

from __future__ import annotations

from torch import nn

from ditops.integrations.flux.forwards import (
    FusedFluxAttnProcessor,
    double_block_forward,
    single_block_forward,
)
from ditops.integrations.shared.adaln_zero import (
    DOUBLE_BYPASSES,
    SINGLE_BYPASSES,
    AdaLNOps,
    norm_out_blocks,
    relied_on_norms,
    zero_norm_problem,
)
from ditops.integrations.shared.base import is_plain_layer_norm
from ditops.integrations.shared.family import Attention, Blocks, FamilySpec, Fused
from ditops.integrations.shared.fingerprints import known, relied


def qk_norm_problems(attn: nn.Module, where: str) -> list[str]:
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


def _double_unfused(block: nn.Module, where: str) -> list[str]:
    """A double-stream block whose norms are not what the fused forward computes (a norm
    of the user's, or of another kind) runs diffusers' forward."""
    found = [zero_norm_problem(block, name, single=False) for name in ("norm1", "norm1_context")]
    for name in ("norm2", "norm2_context"):
        norm = getattr(block, name, None)
        if not is_plain_layer_norm(norm):
            found.append(
                f"{name} is a {type(norm).__name__}, not a LayerNorm without affine parameters"
            )
    return [f for f in found if f]


def _single_unfused(block: nn.Module, where: str) -> list[str]:
    return [f for f in [zero_norm_problem(block, "norm", single=True)] if f]


SPEC = FamilySpec(
    name="flux",
    model_classes=("FluxTransformer2DModel",),
    summary="fused adaLN chain and attention prologue",
    blocks=(
        Blocks(
            ("transformer_blocks",),
            (Fused("FluxTransformerBlock.forward", known("FluxTransformerBlock.forward"),
                   double_block_forward, DOUBLE_BYPASSES, unfused=_double_unfused,
                   attention="attn", prologue=qk_norm_problems),),
        ),
        Blocks(
            ("single_transformer_blocks",),
            (Fused("FluxSingleTransformerBlock.forward",
                   known("FluxSingleTransformerBlock.forward"),
                   single_block_forward, SINGLE_BYPASSES, unfused=_single_unfused,
                   attention="attn", prologue=qk_norm_problems),),
        ),
        norm_out_blocks(),
    ),
    ops=AdaLNOps.of,
    attention=Attention(
        {FusedFluxAttnProcessor.wraps: FusedFluxAttnProcessor},
        known("FluxAttnProcessor.__call__"),
        keep_others=True,  # IP-Adapter's (or the user's) stays; the blocks are fused
    ),
    relied_on=lambda: {
        **relied_on_norms(), **relied("diffusers.models.embeddings", "apply_rotary_emb")
    },
)  # fmt: skip
