"""Visibility (docs/method.md §3) as the 4-D masks each attention backend expects.

`DeferredDynamicCache.add_rows` gives a boolean ``[q, k]`` visibility (True = may attend). The
model's attention functions read the mask differently per backend, and transformers returns a
user-supplied 4-D mask untouched, so the conversion happens here:

- ``sdpa``: a boolean mask, True = attend (`scaled_dot_product_attention`'s convention);
- ``eager``: an additive float mask in the model's dtype (0 = attend, dtype min = masked), because
  the eager path adds the mask to the attention scores.

``flash_attention_2`` takes no arbitrary masks (only causal + padding), so it cannot express a decode
token that sees a chunk stored after it, nor a chunk that skips generated rows stored before it.
"""

from __future__ import annotations

import torch

SUPPORTED_ATTENTION = ("sdpa", "eager")


def check_attention_implementation(impl: str | None) -> str:
    impl = impl or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"Raincheck needs an attention backend that accepts arbitrary masks; the model uses "
            f"attn_implementation={impl!r}. Load it with attn_implementation='sdpa' (or call "
            "model.set_attn_implementation('sdpa')); 'eager' works too. flash_attention_2 cannot express "
            "deferred-token visibility."
        )
    return impl


def visibility_to_attention_mask(visible: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """``visible [q, k]`` (bool) -> ``[1, 1, q, k]`` mask for backend ``impl``."""
    return batched_visibility_to_attention_mask(visible[None], impl, dtype)


def batched_visibility_to_attention_mask(visible: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """``visible [B, q, k]`` (bool, one visibility per sequence of a packed forward) -> ``[B, 1, q, k]`` mask for
    backend ``impl`` (as `visibility_to_attention_mask`)."""
    visible = visible[:, None]
    if impl == "sdpa":
        return visible
    if impl == "eager":
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        return torch.where(visible, zero, torch.finfo(dtype).min)
    raise ValueError(check_attention_implementation(impl))


def reference_visibility(keys: torch.Tensor, forward_index: torch.Tensor) -> torch.Tensor:
    """The slow, obviously correct visibility over *all* rows of a conversation at once.

    Row i may see row j iff j comes no later in the logical order (``keys[j] <= keys[i]``) and j
    had been computed when i was (``forward_index[j] <= forward_index[i]``). Tests run one forward
    with this mask over the physically reordered sequence and compare with the incremental engine.
    """
    return (keys[None, :] <= keys[:, None]) & (forward_index[None, :] <= forward_index[:, None])
