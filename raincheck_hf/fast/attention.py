"""Attention for the fast path's few-query steps: a decode token, a fused ``[chunk, token]`` step.

A fast-path step attends from ``L`` query rows to every slot of the static cache under a boolean
visibility mask, so SDPA cannot take its flash kernel and, on the H200, picked cuDNN's masked kernel:
56 µs per layer for one query over 2,112 slots (36 layers: ≈ 2 ms of a 10.25 ms decode graph, in
`benchmarks/results/profile_qwen3_vl_8b_image_h200.json`), parallel only over the 32 heads. For few
queries the same attention is two small batched matmuls over the key/value heads (the query heads
of a group stacked as rows, GQA without repeating K/V) and a softmax, which spread over all slots.

`few_query_attention` is registered with transformers' `AttentionInterface` (on first use, not at
import) and selected only inside a fast-path step of the calling thread, and only when the model runs
``sdpa``: `fast.scoping.step_scope` gives each attention module a view of its config that names it
there, while the model's config itself keeps ``sdpa`` (other threads never see the switch). Rows above
`FEW_QUERY_MAX` (prefills) and anything it does not handle go to stock `sdpa_attention_forward`,
which is also its reference in the tests.

Precision: scores in float32 (a bf16 score of magnitude ~10 would carry an error of ~0.04 into the
exponent), probabilities cast to the value dtype for the second product, as flash attention does. On CUDA
with half-precision inputs the first product reads the bf16 / fp16 keys as they are and accumulates and
returns float32 (``torch.bmm(..., out_dtype=torch.float32)``, `_scores`): the same products as upcasting
first (a product of two bf16 numbers is exact in float32) without writing a float32 copy of every key, which
at a batch of 8 sequences was most of a decode step's attention time (an fp32 GEMM of 47 µs per layer on the
H200). On the CPU, and inside compiled steps (Inductor fuses the upcast there), the keys are upcast.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

FEW_QUERY_MAX = 64  # query rows up to which the matmul form runs (decode: 1, fused chunk 31: 32)
NAME = "raincheck_few_query_sdpa"
ENABLED = True  # the fast path uses it (False: stock sdpa inside the steps as well)


def few_query_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``query [B, Hq, L, D]``, ``key``/``value [B, Hkv, S, D]``, ``attention_mask [B | 1, 1, L, S]`` (bool,
    True = visible) -> ``([B, L, Hq, D], None)``, what `sdpa_attention_forward` returns."""
    b, hq, rows, d = query.shape
    hkv = key.shape[1]
    usable = (
        rows <= FEW_QUERY_MAX and dropout == 0.0 and attention_mask is not None
        and attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1 and hq % hkv == 0
        and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False)
        and value.shape[-1] == d
    )
    if not usable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = d ** -0.5 if scaling is None else scaling
    from .context import active_scope

    scope = active_scope()
    if scope is not None and scope.compiled:  # RaincheckConfig.compile_steps: the same function, fused by Inductor
        from .compiled import compiled

        return compiled(_few_query)(query, key, value, attention_mask, scale), None
    return _few_query(query, key, value, attention_mask, scale, low_precision_reads=True), None


def low_precision_scores(query, key) -> bool:
    """Whether `_scores` can read half-precision keys as they are (CUDA, bf16 / fp16, torch's ``out_dtype``)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and hasattr(torch.ops.aten.bmm, "dtype"))


def _scores(q, key, scale: float, low_precision_reads: bool):
    """``scale * q @ key^T`` in float32, ``q [B, Hkv, M, D]`` and ``key [B, Hkv, S, D]`` -> ``[B, Hkv, M, S]``.

    With ``low_precision_reads`` on CUDA half-precision inputs: one batched product over (B, Hkv) that reads the
    keys in their dtype and accumulates into a float32 result (no float32 copy of the keys); otherwise both
    operands upcast first (the reference form; also what compiled steps trace)."""
    if low_precision_reads and low_precision_scores(q, key):
        b, hkv, m, d = q.shape
        s = key.shape[2]
        scores = torch.bmm(q.reshape(b * hkv, m, d), key.reshape(b * hkv, s, d).transpose(1, 2),
                           out_dtype=torch.float32)
        return scores.view(b, hkv, m, s).mul_(scale)
    return torch.matmul(q.float() * scale, key.float().transpose(-1, -2))


def _few_query(query, key, value, attention_mask, scale: float, low_precision_reads: bool = False):
    """The matmul form (see `few_query_attention`); ``[B, L, Hq, D]``."""
    b, hq, rows, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    # query head h reads key/value head h // group: stack a group's queries as rows of its key/value head
    q = query.reshape(b, hkv, group * rows, d)
    scores = _scores(q, key, scale, low_precision_reads)  # [B, Hkv, group * L, S], float32
    visible = attention_mask[:, :, None].expand(-1, hkv, group, -1, -1).reshape(attention_mask.shape[0], hkv,
                                                                                 group * rows, -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, group * L, D]
    return out.reshape(b, hq, rows, d).transpose(1, 2).contiguous()


def register() -> None:
    """Make `NAME` a valid attention implementation (once; adding a name changes nothing for other models)."""
    from transformers import AttentionInterface

    if NAME not in AttentionInterface().valid_keys():
        AttentionInterface.register(NAME, few_query_attention)
