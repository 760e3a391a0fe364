"""The vision tower's attention with its rotary embedding in one kernel, inside the fast path's tower forwards.

Stock transformers rotates a vision block's queries and keys (``apply_rotary_pos_emb_vision``) in separate eager
kernels: both cast to float32 from strided views of the ``qkv`` projection, ``rotate_half`` as a negation and a
concatenation, two products and a sum each, two casts back: fourteen launches per block by its code. On the H100 at
Qwen3-VL-8B's shape (a 1,344 x 1,024 image, 5,376 patches, 27 blocks) such element-wise work was ~9 ms of the tower's
30 ms of kernels (`benchmarks/vision_tower_compile.py`). `rotary_qkv` does it in one launch that reads the projection
once and writes the rotated queries and keys with the layout the stock code gives them (``[S, heads, head_dim]``, each
contiguous); everything after (the per-image or per-window attention of the model's backend, the output projection)
is the stock code's.

Exactness: the kernel computes what the stock function computes, in the same float32 operations, each rounded on its
own (the launch turns floating-point contraction off), so the rotated queries and keys equal stock's bit for bit
(checked in Triton's interpreter on CPU and on the GPU). The attention then gets the same values in the same layout.

`vision_attention_scope(tower)` applies it for the calling thread's ``with`` block only (a per-instance patch of
each block's attention, reference-counted, whose code acts only for the thread that set the scope: `patching`), as
`fast.vision_graphs` runs the tower for an eager encode and for a capture; every other call of the shared model sees
the stock modules. It acts where the kernel can run (CUDA tensors, or Triton's interpreter, ``TRITON_INTERPRET=1``,
as the CPU tests run it), without autograd, on a backend other than flash attention (whose varlen path the tower takes
with its own arguments; left stock), and on attention modules of the stock structure (``qkv``, ``proj``,
``num_heads``, ``scaling``); anything else runs the stock forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .._triton import cdiv, pow2, triton_available
from ..patching import CountedPatches, ThreadScoped, install_forward, module_function, patched_for_thread

BLOCK_S = 32  # rows per program
# whether the fast path's tower forwards use it (False: the stock forward there as well; `one_kernel_rotation`)
_ENABLED = contextvars.ContextVar("raincheck_vision_rotation_kernel", default=True)

_PATCHES = CountedPatches()
_SCOPE = ThreadScoped("raincheck_vision_attention")


def rotary_qkv_reference(module, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The stock rotation: ``qkv [S, 3, heads, head_dim]`` -> ``(q, k)`` ``[S, heads, head_dim]`` through the modeling
    file's own ``apply_rotary_pos_emb_vision`` (what the stock attention forward calls)."""
    return module_function(module, "apply_rotary_pos_emb_vision")(qkv[:, 0], qkv[:, 1], cos, sin)


def kernel_usable(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary_qkv` takes these inputs: ``qkv [S, 3, heads, head_dim]`` (the projection's output, its last
    three axes contiguous), ``cos`` / ``sin [S, head_dim]`` with a contiguous last axis, CUDA tensors (or Triton's
    interpreter), an even head size, fp32 / bf16 / fp16, nothing that needs a gradient."""
    if not _device_usable(qkv):
        return False
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        return False
    s, _, h, d = qkv.shape
    return (d % 2 == 0 and qkv.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and qkv.stride(3) == 1 and qkv.stride(2) == d and qkv.stride(1) == h * d
            and all(t.dim() == 2 and tuple(t.shape) == (s, d) and t.stride(1) == 1 and t.device == qkv.device
                    and t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in (cos, sin))
            and not (torch.is_grad_enabled() and (qkv.requires_grad or cos.requires_grad or sin.requires_grad)))


def _device_usable(tensor: torch.Tensor) -> bool:
    return (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and triton_available()


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rotary_qkv_reference`'s ``(q, k)`` from one Triton launch (inputs as `kernel_usable` takes them): two views of
    one ``[2, S, heads, head_dim]`` tensor of ``qkv``'s dtype."""
    from ._triton_vision import vision_rotary

    s, _, h, d = qkv.shape
    out = torch.empty((2, s, h, d), dtype=qkv.dtype, device=qkv.device)
    if s:
        vision_rotary[(cdiv(s, BLOCK_S), h)](
            qkv, cos, sin, out, s, qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0),
            H=h, D=d, HALF=d // 2, BLOCK_S=BLOCK_S, BLOCK_HALF=pow2(d // 2), enable_fp_fusion=False)
    return out[0], out[1]


def fused_forward(module, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """The stock vision attention forward (transformers' ``Qwen3VLVisionAttention`` and its copies in Qwen3.5 and
    Qwen2.5-VL, non-flash backends) with its rotation from `rotary_qkv`; the stock forward where that cannot run."""
    if (position_embeddings is None or "flash" in str(module.config._attn_implementation or "")
            or not _device_usable(hidden_states)):
        return type(module).forward(module, hidden_states, cu_seqlens, position_embeddings=position_embeddings,
                                    max_seqlen=max_seqlen, **kwargs)
    seq_length = hidden_states.shape[0]
    qkv = module.qkv(hidden_states).reshape(seq_length, 3, module.num_heads, -1)
    cos, sin = position_embeddings
    if kernel_usable(qkv, cos, sin):
        query, key = rotary_qkv(qkv, cos, sin)
    else:  # (the stock rotation: the rest is the stock forward's either way)
        query, key = rotary_qkv_reference(module, qkv, cos, sin)
    value = qkv[:, 2]
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                      module_function(module, "eager_attention_forward"))
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outputs = [
        attention(module, q, k, v, attention_mask=None, scaling=module.scaling,
                  dropout=0.0 if not module.training else module.attention_dropout, is_causal=False, **kwargs)[0]
        for q, k, v in zip(*(torch.split(t, lengths, dim=2) for t in (query, key, value)))
    ]
    out = torch.cat(outputs, dim=1).reshape(seq_length, -1).contiguous()
    return module.proj(out)


_STOCK_PARAMETERS = ("hidden_states", "cu_seqlens", "position_embeddings", "max_seqlen")


def _stock_structure(module) -> bool:
    """Whether ``module`` is a vision attention `fused_forward` reproduces: the stock forward's parameters and
    attributes, and a modeling file with the two functions it calls."""
    return (_stock_class(type(module)) and all(hasattr(module, a) for a in ("qkv", "proj", "num_heads", "scaling"))
            and isinstance(module.qkv, torch.nn.Linear))


@functools.lru_cache(maxsize=None)
def _stock_class(cls) -> bool:
    try:
        names = tuple(inspect.signature(cls.forward).parameters)[1:5]
    except (TypeError, ValueError):
        return False
    modeling = sys.modules.get(cls.__module__)
    return names == _STOCK_PARAMETERS and all(callable(getattr(modeling, name, None)) for name in
                                              ("apply_rotary_pos_emb_vision", "eager_attention_forward"))


def _install(module):
    """Make ``module`` run `fused_forward` for the thread inside `vision_attention_scope` (its stock ``forward``
    for every other); returns the undo callable."""
    return install_forward(module, lambda: bool(_SCOPE.get()), fused_forward)


def attention_modules(tower) -> list:
    """The attention modules of ``tower``'s blocks that `fused_forward` can run (none where it has no ``blocks``)."""
    blocks = getattr(tower, "blocks", None) or ()
    return [block.attn for block in blocks if hasattr(block, "attn") and _stock_structure(block.attn)]


def rotation_kernel_enabled() -> bool:
    """Whether the fast path's tower forwards of this thread (or task) rotate in one kernel (`one_kernel_rotation`;
    True unless a benchmark turned it off)."""
    return _ENABLED.get()


@contextlib.contextmanager
def one_kernel_rotation(enabled: bool):
    """Within the block (this thread or task only), whether the fast path's tower forwards rotate queries and keys
    in one kernel (``True``, the default) or run the stock forward (``False``): the same values either way; for the
    benchmark that times both (`benchmarks/vision_rotary_t1.py`) and tests. The tower's captured graphs are kept per
    setting (`fast.vision_graphs`)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"one_kernel_rotation: enabled={enabled!r} must be True or False")
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


@contextlib.contextmanager
def vision_attention_scope(tower, enabled: bool | None = None):
    """For the ``with`` block, the calling thread's forwards of ``tower`` run its blocks' attention as
    `fused_forward` (where it applies: see the module docstring). ``enabled``: None follows `one_kernel_rotation`."""
    if not (_ENABLED.get() if enabled is None else enabled):
        yield
        return
    with patched_for_thread(_PATCHES, attention_modules(tower), _install, _SCOPE, True):
        yield
