"""What every model adapter shares: the engine's row types, device helpers and the `ModelAdapter` interface.

The engine (`generation.py`, `fast/`, `selection/`, `conversation.py`) talks to a model only through an
adapter: the rows of a turn (`TurnInputs`), the rows of one forward (`RowBatch`) and the methods of
`ModelAdapter`. A family's quirks live in its own `models/<family>.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import Segment


@dataclass
class TurnInputs:
    """One turn's new tokens, encoded. ``L`` rows, ``n`` of them visual.

    Attributes:
        input_ids: ``[L]``.
        embeds: ``[L, D]`` input embeddings with the visual features scattered into placeholder rows.
        positions: ``[3, L]`` absolute M-RoPE ids (continuing the conversation).
        visual_index: ``[L]`` index into the visual rows, -1 for text rows.
        deepstack: one ``[n, D]`` tensor per DeepStack layer (visual rows in source order), or None.
        segments: the multimodal segments (an image, or one temporal slice of a video) in source order.
        text_rows: ``[m]`` rows of the turn's text (the question a query-aware selector reads).
        next_position: M-RoPE text position following the last row.
    """

    input_ids: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor
    visual_index: torch.Tensor
    deepstack: list[torch.Tensor] | None
    segments: list[Segment]
    text_rows: torch.Tensor
    next_position: int

    @property
    def num_visual(self) -> int:
        return int((self.visual_index >= 0).sum())


@dataclass
class RowBatch:
    """The rows of one forward, in storage order: ``embeds [L, D]``, ``positions [3, L]``,
    ``visual [L]`` (bool), ``deepstack`` (one ``[n_visual_in_batch, D]`` per layer, or None)."""

    embeds: torch.Tensor
    positions: torch.Tensor
    visual: torch.Tensor
    deepstack: list[torch.Tensor] | None

    @staticmethod
    def concat(parts: list["RowBatch"]) -> "RowBatch":
        parts = [p for p in parts if p is not None]
        if len(parts) == 1:
            return parts[0]
        with_ds = [p.deepstack for p in parts if p.deepstack is not None]
        deepstack = [torch.cat(layer) for layer in zip(*with_ds)] if with_ds else None
        return RowBatch(
            torch.cat([p.embeds for p in parts]),
            torch.cat([p.positions for p in parts], dim=1),
            torch.cat([p.visual for p in parts]),
            deepstack,
        )


def _hook_devices(module):
    """``(execution_device, offloads)`` of each accelerate `AlignDevicesHook` on ``module`` (none without hooks)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # SequentialHook or one hook
        device = getattr(h, "execution_device", None)
        if device is not None:
            device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        yield device, bool(getattr(h, "offload", False))


def execution_device(module) -> torch.device:
    """The device ``module`` computes on, also when accelerate dispatched or offloaded it.

    A module with an accelerate `AlignDevicesHook` (``device_map=...``, `dispatch_model`, `cpu_offload`)
    runs on the hook's ``execution_device`` whatever its parameters' device (``meta`` when offloaded);
    otherwise it is the device of its first parameter that holds data, CPU for a module without any.
    """
    for device, _ in _hook_devices(module):
        if device is not None:
            return device
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def accelerate_split(model) -> str | None:
    """How accelerate split ``model`` (a phrase for error messages), or None when it runs whole on one device.

    Split = its modules' hooks execute on more than one device, or some hook offloads weights (cpu / disk
    offload: the parameters sit on ``meta`` between forwards). A model without hooks is not split.
    """
    devices, offloaded = set(), 0
    for module in model.modules():
        for device, offloads in _hook_devices(module):
            if device is not None:
                devices.add(str(device))
            offloaded += offloads
    parts = []
    if len(devices) > 1:
        parts.append(f"over the devices {sorted(devices)}")
    if offloaded:
        parts.append(f"with the weights of {offloaded} modules offloaded (cpu / disk)")
    return " and ".join(parts) or None
