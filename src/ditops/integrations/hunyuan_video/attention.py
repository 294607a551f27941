"""HunyuanVideo's joint attention on ditops' ops: the fused q/k prologue and sparse attention.

``HunyuanVideoAttnProcessor2_0`` (diffusers 0.42) attends over ``cat([video, text])``:

* single-stream blocks (no ``add_q_proj``): q/k/v projected from the concatenation,
  ``norm_q``/``norm_k`` (diffusers' ``RMSNorm`` per head) on every row, the rotary
  embedding on the video rows only (``apply_rotary_emb``, interleaved pairs, fp32);
* double-stream blocks: the video tokens' q/k normed and rotated, the text tokens' own
  projections normed by ``norm_added_q``/``norm_added_k`` (not rotated), text last;

then one attention with the model's ``[B, 1, 1, N]`` key mask (padded text tokens are
masked as keys; every query row attends). HunyuanVideo-1.5's processor
(``HunyuanVideo15AttnProcessor2_0``, double-stream blocks only) is the same but for the
mask: it is given the ``[B, text]`` text mask and masks padded text as keys *and* as
queries (``[B, 1, N, N]``). :class:`HunyuanVideoAttnProcessor` runs the
same: ``qk_norm_rope`` (``convention="diffusers"``) on the video rows, ``rms_norm`` on the
text rows, and diffusers' ``dispatch_attention_fn`` with the mask: in exact precision
bitwise what the original computes (a norm row does not see the other rows).

Sparse steps (``attention=BlockSparseConfig(...)``) run the joint attention of
:mod:`~ditops.integrations.shared.joint_sparse` (text last): text queries dense with
their rows of the model's mask, video queries block-sparse over the text keys the mask
keeps (padded ones left out: masked exactly) and the video keys, with the kept text, the
first frame and, for HunyuanVideo-Framepack, the history and clean latents before the
generated video as the leading dense blocks; a sample whose padded text is not finite
runs dense with the mask, as the meaning gives NaN there.

Calls this was not written for (no rotary tables, tables other than ``[L, D]``, a mask
other than the model's key mask on a sparse step) run the original processor or dense.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ditops.integrations.shared.adaln_zero import AdaLNOps
from ditops.integrations.shared.guard import Bypass, float64_call
from ditops.integrations.shared.joint_sparse import joint_sparse_attention
from ditops.integrations.shared.processors import WrappingProcessor
from ditops.integrations.shared.qk_norms import rms_problems
from ditops.integrations.shared.steps import StepState, runs_dense
from ditops.tracing import refuse_under_fullgraph, traced


def single_stream_branches(
    block: nn.Module,
    n: torch.Tensor,
    text: int,
    attention_mask: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """A HunyuanVideo single-stream block between its modulation ``n`` (``[video, text]``
    rows) and its gated residual: the attention over the video and text rows and the MLP
    branch, projected together by ``proj_out`` (diffusers' operations)."""
    mlp_hidden_states = block.act_mlp(block.proj_mlp(n))
    attn_output, context_attn_output = block.attn(
        hidden_states=n[:, :-text],
        encoder_hidden_states=n[:, -text:],
        attention_mask=attention_mask,
        image_rotary_emb=image_rotary_emb,
    )
    attn_output = torch.cat([attn_output, context_attn_output], dim=1)
    return block.proj_out(torch.cat([attn_output, mlp_hidden_states], dim=2))


@functools.cache
def _rms_norm_class() -> type:
    from diffusers.models.normalization import RMSNorm

    return RMSNorm


def _prologue_bypass(attn: nn.Module) -> Bypass:
    """The q/k norms the fused prologue computes without calling them."""
    names = ["norm_q", "norm_k"]
    if getattr(attn, "add_q_proj", None) is not None:
        names += ["norm_added_q", "norm_added_k"]
    return Bypass(tuple((name, _rms_norm_class()) for name in names))


def _heads(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(2, (attn.heads, -1))


class HunyuanVideoAttnProcessor(WrappingProcessor):
    """``HunyuanVideoAttnProcessor2_0`` with the prologue on ditops' ops (``ops``, None:
    diffusers' norms and rotation) and optional block-sparse attention (``sparse``).

    ``text_mask``: HunyuanVideo-1.5's ``HunyuanVideo15AttnProcessor2_0``, which is given
    the ``[B, text]`` text mask and makes the ``[B, 1, N, N]`` mask itself (padded text
    masked as keys and as queries), with the same code as diffusers.

    The attention backend and the parallel config live on the wrapped original (see
    :class:`~ditops.integrations.shared.processors.WrappingProcessor`).
    """

    text_mask_default = False
    #: The diffusers processor this class wraps: (module, class name).
    wraps = (
        "diffusers.models.transformers.transformer_hunyuan_video",
        "HunyuanVideoAttnProcessor2_0",
    )

    ops: AdaLNOps | None

    def __init__(
        self,
        original: Any | None = None,
        ops: AdaLNOps | None = None,
        steps: StepState | None = None,
        sparse: nn.Module | None = None,
        text_mask: bool | None = None,
    ) -> None:
        super().__init__(original, ops, steps, sparse)
        self.text_mask = self.text_mask_default if text_mask is None else text_mask

    def _ops_now(self, attn: nn.Module) -> AdaLNOps | None:
        """The ops for this call: None while the q/k norms are hooked or replaced (then
        diffusers' norms run, as their hooks expect)."""
        if self.ops is None or _prologue_bypass(attn).problem(attn) is not None:
            return None
        return self.ops

    def _dense_now(self) -> bool:
        return runs_dense(self.sparse, self.steps)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if self.sparse is not None and traced():
            refuse_under_fullgraph(
                "ditops: HunyuanVideo's sparse attention cannot compile with fullgraph=True: "
                "it reads each sample's text mask on the host (which text keys are padded), "
                "a graph break. Compile with fullgraph=False, or patch without attention= "
                "for a fullgraph compile."
            )
        dense = self._dense_now()
        ops = self._ops_now(attn)
        if (
            float64_call(hidden_states)  # cast after the patch: the meaning, dense
            or encoder_hidden_states is None
            or image_rotary_emb is None
            or image_rotary_emb[0].dim() != 2
            or (ops is None and dense)
        ):
            return self.original(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        text = encoder_hidden_states.shape[1]
        query, key, value = self._qkv(
            attn, ops, hidden_states, encoder_hidden_states, image_rotary_emb
        )
        given = attention_mask
        if self.text_mask:  # HunyuanVideo-1.5: the processor makes the [B, 1, N, N] mask
            attention_mask = _self_attention_mask(given, *query.shape[:2])
        if dense:
            out = self._dispatch_dense(query, key, value, attention_mask)
        else:
            batch, n = query.shape[:2]
            if self.text_mask:
                keep = _text_mask_of(given, batch, text)
                rows = attention_mask[:, :, n - text :]
            else:
                keep = _text_keys_kept(attention_mask, batch, n, n - text, query.device)
                rows = attention_mask
            out = self._sparse_attention(query, key, value, keep, rows, text)
        out = out.flatten(2, 3).to(query.dtype)
        hidden_states, encoder_hidden_states = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states

    def _qkv(
        self,
        attn: nn.Module,
        ops: AdaLNOps | None,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, video + text, H, D]``: normed, video rows rotated, text last."""
        text = encoder_hidden_states.shape[1]
        joint = attn.add_q_proj is None
        x = torch.cat([hidden_states, encoder_hidden_states], dim=1) if joint else hidden_states
        query, key, value = (_heads(attn, f(x)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if joint:  # text rows share the projections and norms, not the rotation
            (q, tq), (k, tk) = ((t[:, :-text], t[:, -text:]) for t in (query, key))
            nq, nk = attn.norm_q, attn.norm_k
        else:
            q, k = query, key
            tq, tk, tv = (
                _heads(attn, f(encoder_hidden_states))
                for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            )
            value = torch.cat([value, tv], dim=1)
            nq, nk = attn.norm_added_q, attn.norm_added_k
        q, k, tq, tk = self._prologue(attn, ops, q, k, tq, tk, nq, nk, rotary)
        return torch.cat([q, tq], dim=1), torch.cat([k, tk], dim=1), value

    def _prologue(
        self,
        attn: nn.Module,
        ops: AdaLNOps | None,
        q: torch.Tensor,
        k: torch.Tensor,
        tq: torch.Tensor,
        tk: torch.Tensor,
        text_norm_q: nn.Module,
        text_norm_k: nn.Module,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        if ops is None:  # sparse without the fused prologue: diffusers' own modules
            from diffusers.models.embeddings import apply_rotary_emb

            q = apply_rotary_emb(attn.norm_q(q), rotary, sequence_dim=1)
            k = apply_rotary_emb(attn.norm_k(k), rotary, sequence_dim=1)
            return q, k, text_norm_q(tq), text_norm_k(tk)
        # apply_rotary_emb rotates in fp32 whatever the tables' dtype: so does the op
        # given fp32 tables (a no-op for HunyuanVideoRotaryPosEmbed's, which are fp32).
        cos, sin = (t.to(q.device, torch.float32) for t in rotary)
        nq, nk = attn.norm_q, attn.norm_k
        q, k = ops.qk(q, k, nq.weight, nk.weight, cos, sin, nq.eps, convention="diffusers")
        rms = ops.rms
        tq = rms(tq, text_norm_q.weight, text_norm_q.eps, "diffusers")
        tk = rms(tk, text_norm_k.weight, text_norm_k.eps, "diffusers")
        return q, k, tq, tk

    def _sparse_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        keep: torch.Tensor,
        text_rows_mask: torch.Tensor | None,
        text: int,
    ) -> torch.Tensor:
        """Video rows block-sparse over [kept text, video] keys, text rows dense with their
        rows of the model's mask (see the module docstring); ``[B, N, H, D]`` in and out.
        ``keep``: bool ``[B, text]``, the text keys the mask keeps."""
        assert self.sparse is not None and self.steps is not None
        if self._parallel_config is not None:
            raise NotImplementedError(
                "ditops: sparse attention for HunyuanVideo under context parallelism is not "
                "supported (diffusers gives HunyuanVideo no context-parallel plan); patch "
                "with attention=None"
            )
        return joint_sparse_attention(
            self.sparse,
            self.steps,
            query,
            key,
            value,
            text,
            self._dense_masked,
            text_first=False,
            keep=keep,
            text_rows_mask=text_rows_mask,
            video_lead=self._leading_video_tokens(query.shape[1] - text),
        )

    def _dense_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(q, k, v, attn_mask=mask, backend=self._attention_backend)

    def _leading_video_tokens(self, video: int) -> int:
        """Video rows whose keys run dense on sparse steps: the first generated frame's, and
        every row before the generated video (HunyuanVideo-Framepack puts its history and
        clean latents there: the context the new frames are made from). 0 when the latent
        shape is not known."""
        assert self.steps is not None
        shape = self.steps.latent_shape
        if shape is None:
            return 0
        pt, ph, pw = self.steps.patch_size[-3:]
        frame = (int(shape[-2]) // ph) * (int(shape[-1]) // pw)
        generated = (int(shape[-3]) // pt) * frame
        context = video - generated if generated <= video else 0
        return min(context + frame, video)


class HunyuanVideo15AttnProcessor(HunyuanVideoAttnProcessor):
    """:class:`HunyuanVideoAttnProcessor` over ``HunyuanVideo15AttnProcessor2_0`` (given
    the ``[B, text]`` text mask), so ``type(p)()`` builds what HunyuanVideo-1.5 needs."""

    text_mask_default = True
    wraps = (
        "diffusers.models.transformers.transformer_hunyuan_video15",
        "HunyuanVideo15AttnProcessor2_0",
    )


def _self_attention_mask(text_mask: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """``HunyuanVideo15AttnProcessor2_0``'s mask from the ``[B, text]`` one, as it makes it."""
    import torch.nn.functional as F

    mask = F.pad(text_mask, (n - text_mask.shape[1], 0), value=True).bool()
    rows = mask.view(batch, 1, 1, n).repeat(1, 1, n, 1)
    return (rows & rows.transpose(2, 3)).bool()


def _text_mask_of(mask: torch.Tensor | None, batch: int, text: int) -> torch.Tensor:
    """Bool ``[B, text]`` from HunyuanVideo-1.5's text mask, refused if it is not one."""
    if mask is None or tuple(mask.shape) != (batch, text):
        shape = None if mask is None else list(mask.shape)
        raise ValueError(
            f"ditops: sparse HunyuanVideo-1.5 attention takes the [B, text] = [{batch}, {text}] "
            f"text mask the model passes; got {shape}"
        )
    return mask.bool()


def _text_keys_kept(
    mask: torch.Tensor | None, batch: int, n: int, video: int, device: torch.device
) -> torch.Tensor:
    """Bool ``[B, text]``: which text keys the model's mask keeps. The model's mask is a
    key mask ``[B, 1, 1, N]`` (or ``[B, N]``) keeping every video key; anything else
    is refused, never guessed at."""
    if mask is None:
        return torch.ones(batch, n - video, dtype=torch.bool, device=device)
    if mask.dtype != torch.bool or mask.numel() != batch * n or mask.shape[-1] != n:
        raise ValueError(
            "ditops: sparse HunyuanVideo attention takes the model's boolean key mask "
            f"[B, 1, 1, N] (B={batch}, N={n}); got {mask.dtype} {list(mask.shape)}"
        )
    rows = mask.reshape(batch, n)
    if not bool(rows[:, :video].all()):
        raise ValueError(
            "ditops: sparse HunyuanVideo attention: the mask masks video keys; only padded "
            "text keys (the model's own mask) are supported"
        )
    return rows[:, video:]


# --- what the processor relies on, checked before a patch ------------------------------------


def attention_problems(block: nn.Module, where: str, double: bool) -> list[str]:
    """What the processor relies on in a block's attention (its processor's class is the
    skeleton's check): diffusers' RMSNorms for q/k (and the text's in a double-stream
    block), added projections exactly in double-stream blocks."""
    attn = getattr(block, "attn", None)
    if attn is None:
        return [f"{where} has no attn"]
    problems = rms_problems(attn, ("norm_q", "norm_k"), f"{where}.attn")
    if (attn.add_q_proj is not None) != double:
        problems.append(f"{where}.attn: added projections do not match the block's kind")
    if double:
        problems += rms_problems(attn, ("norm_added_q", "norm_added_k"), f"{where}.attn")
    return problems
