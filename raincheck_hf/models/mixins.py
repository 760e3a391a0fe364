"""Pieces of `ModelAdapter` that several families share (the families compose them; none inherits another's adapter).

- `QwenVisionLanguageMixin`: Qwen's multimodal prompt (``<|image_pad|>`` / ``<|video_pad|>`` placeholder
  rows, ``get_image_features`` / ``get_video_features``, the model's own 3-D rope index) and its vision
  blocks (``norm1`` -> ``attn.qkv`` -> vision rotary). Every supported family.
- `Qwen3VisionTowerMixin`: the Qwen3 vision tower (learned position embedding resampled per grid), whose
  grid bookkeeping the fast path precomputes. Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE.
- `DeepStackMixin`: DeepStack features added to the first text layers. Qwen3-VL, Qwen3-VL-MoE.
"""

from __future__ import annotations

import torch

from ..cache_utils import to_device, to_device_all
from ..patching import module_function
from ..selection import Segment
from .base import TurnInputs


class QwenVisionLanguageMixin:
    """Encoding of a Qwen vision-language prompt through the model's public methods."""

    def __init__(self, model):
        super().__init__(model)
        self.image_token_id = self.config.image_token_id
        self.video_token_id = self.config.video_token_id
        self._non_question_ids = torch.tensor(
            [self.image_token_id, self.video_token_id, self.config.vision_start_token_id,
             self.config.vision_end_token_id]
        )

    def placeholder_masks(self, input_ids: torch.Tensor, text_prefix: int = 0):
        """``(is_image, is_video)`` over ``input_ids``, the first ``text_prefix`` rows counted as text."""
        is_image, is_video = input_ids == self.image_token_id, input_ids == self.video_token_id
        if text_prefix:
            is_image[:text_prefix] = False
            is_video[:text_prefix] = False
        return is_image, is_video

    # ---- encoding -------------------------------------------------------------------------
    def _vision_outputs(self, modality, mm_encoder_outputs, pixel_values, grid, vision_graphs=None):
        out = (mm_encoder_outputs or {}).get(modality)
        if out is None and pixel_values is not None:
            if vision_graphs is not None:  # the fast path's tower: same outputs, replayed per grid
                return vision_graphs.encode(pixel_values, grid)
            encode = self.model.model.get_image_features if modality == "image" else self.model.model.get_video_features
            out = encode(pixel_values, grid, return_dict=True)
        return out

    def _rope_index(self, ids, mm_types, image_grid_thw, video_grid_thw, second_per_grid_ts):
        """``[3, L]`` 3-D positions of one turn's rows from 0 (the model's own ``get_rope_index``)."""
        positions, _ = self.model.model.get_rope_index(
            ids[None], mm_types[None], image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw
        )
        return positions[:, 0]

    def encode_turn(
        self,
        input_ids: torch.Tensor,
        position_offset: int,
        mm_encoder_outputs: dict | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        text_prefix: int = 0,
        vision_graphs=None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> TurnInputs:
        """Embed one turn's new tokens ``input_ids [L]`` and compute their absolute 3-D positions.

        The first ``text_prefix`` rows are text whatever their ids: the previous answer's last token
        (generated, never fed back yet) is text even if a model happened to emit a placeholder id.
        ``vision_graphs`` (a `fast.vision_graphs.VisionGraphs` of this model's tower) encodes the pixels
        instead of ``get_image_features`` / ``get_video_features``. ``second_per_grid_ts`` (``[n_videos]``,
        Qwen2.5-VL's processor) spaces video frames in time for families whose rope index reads it.
        """
        # Which rows are what is decided on the host, from one copy of the ids: on a GPU each count, mask read or masked
        # assignment over device tensors waits for the device (and gives the interpreter up to a server's other
        # threads meanwhile); the device gets index tensors in one copy.
        host_ids = input_ids.reshape(-1).cpu()
        # the grids too, now, while the device's queue is short: the rope index and the segments read them after the
        # tower is launched, where a read of a device tensor would wait for the tower to end
        host_image_grid, host_video_grid, host_seconds = (
            None if t is None else t.cpu() for t in (image_grid_thw, video_grid_thw, second_per_grid_ts))
        if host_ids.numel() > text_prefix and int(host_ids[-1]) in (self.image_token_id, self.video_token_id):
            # The first token's logits are the last row's, and what follows continues from it: a placeholder there
            # could be deferred, and stock `generate` would continue each M-RoPE axis of it on its own.
            kind = "image" if int(host_ids[-1]) == self.image_token_id else "video"
            raise ValueError(
                f"the prompt ends with a <|{kind}_pad|> placeholder (id {int(host_ids[-1])}); generate(raincheck=...) "
                "answers from a prompt that ends with text. Close the image or video with its <|vision_end|> and the "
                "turn's text, as the processor's chat template does (apply_chat_template(..., add_generation_prompt=True))."
            )
        device = self.device
        ids = input_ids.to(device)
        embeds = self.text_model.embed_tokens(ids)
        is_image, is_video = self.placeholder_masks(host_ids, text_prefix)  # (host)
        is_visual = is_image | is_video
        visual_rows = is_visual.nonzero().flatten()
        n_visual = int(visual_rows.numel())
        image_pos = is_image[visual_rows]  # per visual row in source order: an image's (else a video's)
        visual_index = torch.full_like(host_ids, -1)
        visual_index[visual_rows] = torch.arange(n_visual)
        question = ~torch.isin(host_ids, self._non_question_ids)
        question[:text_prefix] = False
        where = {"image": image_pos.nonzero().flatten(), "video": (~image_pos).nonzero().flatten()}
        host_mm_types = is_image.long() + 2 * is_video.long()
        rows_on, where_image, where_video, visual_index_on, text_rows = to_device_all(
            [visual_rows, where["image"], where["video"], visual_index, question.nonzero().flatten()], device)
        where_on = {"image": where_image, "video": where_video}

        # visual features in source order (images and videos may interleave)
        feats = embeds.new_zeros(n_visual, embeds.shape[-1])
        deepstack = None
        for modality, values, grid in (("image", pixel_values, image_grid_thw),
                                       ("video", pixel_values_videos, video_grid_thw)):
            n_rows = int(where[modality].numel())
            out = self._vision_outputs(modality, mm_encoder_outputs, values, grid, vision_graphs)
            if out is None:
                if n_rows:
                    raise ValueError(
                        f"the new tokens hold {n_rows} <|{modality}_pad|> placeholders but no {modality} "
                        f"features were given (pass the processor's pixel_values{'' if modality == 'image' else '_videos'} "
                        f"and {modality}_grid_thw for the {modality}s of this turn only)."
                    )
                continue
            pooled = torch.cat(list(out.pooler_output)).to(device, embeds.dtype)
            if pooled.shape[0] != n_rows:
                raise ValueError(
                    f"{modality} features ({pooled.shape[0]} rows) do not match the {n_rows} <|{modality}_pad|> "
                    f"placeholders among the new tokens; pass only the {modality}s of the new turn."
                )
            feats.index_copy_(0, where_on[modality], pooled)
            deepstack_features = getattr(out, "deepstack_features", None)
            if deepstack_features is not None and self.has_deepstack:
                if deepstack is None:
                    deepstack = [embeds.new_zeros(n_visual, embeds.shape[-1]) for _ in deepstack_features]
                for layer, feat in zip(deepstack, deepstack_features):
                    layer.index_copy_(0, where_on[modality], torch.cat(list(feat)).to(device, embeds.dtype))
        embeds = embeds.clone()
        embeds.index_copy_(0, rows_on, feats)

        # absolute 3-D positions: the model's own rope index on this turn, shifted to continue; computed on the host
        # from the host copies (the same function: on device tensors it ran a few dozen small kernels after waiting for
        # the tower, ~1 ms of a first token on an H100) and sent in one copy that does not wait for the device
        positions = self._rope_index(host_ids, host_mm_types, host_image_grid, host_video_grid, host_seconds)
        positions = positions + position_offset
        # what follows the turn continues from its LAST row, as stock `generate` advances the position ids column by
        # column (and as the rope index over the whole dialogue places the answer): not from the largest position,
        # which a video's temporal ids can exceed (Qwen2.5-VL spaces them by tokens_per_second / fps: at 0.5-1 fps
        # they run past the text after the video). A turn ends with text (checked above), whose three axes agree, so
        # one number places every generated token (`text_row`) and the next turn.
        next_position = int(positions[:, -1].max()) + 1 if positions.numel() else position_offset
        positions = to_device(positions, device)

        segments = self._segments(ids, is_visual, is_image, feats, deepstack, host_image_grid, host_video_grid)
        return TurnInputs(ids, embeds, positions, visual_index_on, deepstack, segments, text_rows, next_position,
                          visual_rows=visual_rows, host_ids=host_ids)

    def _segments(self, ids, is_visual, is_image, feats, deepstack, image_grid_thw, video_grid_thw):
        """One segment per image and per video temporal slice, in source order.

        A slice is ``h * w`` merged tokens of its grid; placeholder runs are cut at slice boundaries (Qwen3's
        processors write one run per slice, Qwen2.5-VL's one run per video) and where a run ends.
        """
        merge = self.config.vision_config.spatial_merge_size
        grids = {"image": [], "video": []}
        if image_grid_thw is not None:
            grids["image"] = [(1, int(h) // merge, int(w) // merge) for t, h, w in image_grid_thw.tolist()
                              for _ in range(int(t))]
        if video_grid_thw is not None:
            grids["video"] = [(1, int(h) // merge, int(w) // merge) for t, h, w in video_grid_thw.tolist()
                              for _ in range(int(t))]
        # on the host: one copy, not a device read per row (a 1,344-token image made 2,688 syncs)
        rows = is_visual.nonzero().flatten().cpu()
        row_is_image = is_image.cpu()[rows]
        # a run starts where the rows stop being contiguous or the modality changes
        starts = torch.ones(rows.numel(), dtype=torch.bool)
        if rows.numel() > 1:
            starts[1:] = (rows[1:] != rows[:-1] + 1) | (row_is_image[1:] != row_is_image[:-1])
        bounds = starts.nonzero().flatten().tolist() + [rows.numel()]
        segments = []
        counters = {"image": 0, "video": 0}
        for run_start, run_end in zip(bounds[:-1], bounds[1:]):
            modality = "image" if bool(row_is_image[run_start]) else "video"
            start = run_start
            while start < run_end:
                grid_list = grids[modality]
                if counters[modality] < len(grid_list):
                    grid = grid_list[counters[modality]]
                    end = min(run_end, start + grid[1] * grid[2])
                else:
                    grid, end = (1, 1, run_end - start), run_end
                counters[modality] += 1
                vis = torch.arange(start, end, device=feats.device)
                extras = {} if deepstack is None else {"deepstack": [d[vis] for d in deepstack]}
                segments.append(Segment(len(segments), modality, feats[vis], grid, rows[start:end].clone(), extras))
                start = end
        return segments

    # ---- the vision blocks (VisionZip) ------------------------------------------------------
    @torch.no_grad()
    def vision_block_query_key(self, block, hidden_states: torch.Tensor, position_embeddings):
        """``(q, k, scaling)`` of a Qwen vision block: ``norm1`` -> ``attn.qkv`` -> the modeling file's
        ``apply_rotary_pos_emb_vision``; ``q``, ``k`` ``[heads, P, head_dim]`` float32."""
        attn = block.attn
        x = block.norm1(hidden_states)
        qkv = attn.qkv(x).reshape(x.shape[0], 3, attn.num_heads, -1)
        cos, sin = position_embeddings
        q, k = module_function(attn, "apply_rotary_pos_emb_vision")(qkv[:, 0], qkv[:, 1], cos, sin)
        return q.float().transpose(0, 1), k.float().transpose(0, 1), float(attn.scaling)


def _uses_flash_varlen(tower) -> bool:
    return "flash" in str(getattr(tower.config, "_attn_implementation", "") or "")


class Qwen3VisionTowerMixin:
    """The Qwen3 vision tower (Qwen3-VL and Qwen3.5, dense and MoE): replayable per grid."""

    supports_vision_graphs = True

    @staticmethod
    def vision_input_device(tower) -> torch.device:
        return tower.patch_embed.proj.weight.device

    @staticmethod
    def vision_grid_kwargs(tower, grid_thw: torch.Tensor) -> dict:
        """The resampled position embedding's taps and weights, rotary positions and window boundaries for
        ``grid_thw``. ``cu_seqlens`` stays on the host for the SDPA / eager backends, which only read the
        window lengths from it (a device tensor would be read back inside the graph)."""
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import (
            get_vision_attention_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )

        device = tower.patch_embed.proj.weight.device
        grid = grid_thw.to("cpu")
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size,
        )
        position_ids = get_vision_position_ids(grid, tower.spatial_merge_size)
        cu_seqlens, _ = get_vision_attention_seqlens(grid, tower.config)
        kwargs = {"interp_indices": indices.to(device), "interp_weights": weights.to(device),
                  "position_ids": position_ids.to(device)}
        if _uses_flash_varlen(tower):
            kwargs["cu_seqlens"] = cu_seqlens.to(device)
            kwargs["max_seqlen"] = get_max_seqlen(cu_seqlens, tower.config)
        else:
            kwargs["cu_seqlens"] = cu_seqlens
        return kwargs


class DeepStackMixin:
    """DeepStack: the tower's intermediate features are added to the hidden states of the first text layers
    (``visual_pos_masks`` / ``deepstack_visual_embeds`` of the text model)."""

    has_deepstack = True

    @property
    def num_deepstack_layers(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or [])

    def deepstack_layers(self) -> list:
        return list(self.text_model.layers[: self.num_deepstack_layers])

    def deepstack_kwargs(self, visual: torch.Tensor, deepstack: list[torch.Tensor] | None) -> dict:
        if deepstack is None or not bool(visual.any()):
            return {}
        return {"visual_pos_masks": visual[None], "deepstack_visual_embeds": deepstack}

    def packed_deepstack_kwargs(self, visual: torch.Tensor, deepstack: list[torch.Tensor] | None) -> dict:
        # the features' rows are the visual rows: their count is a shape, read without waiting for the device
        if deepstack is None or not deepstack or deepstack[0].shape[0] == 0:
            return {}
        return {"visual_pos_masks": visual, "deepstack_visual_embeds": deepstack}


class ExpertsMixin:
    """Text models with transformers' mixture-of-experts MLPs (``@use_experts_implementation``).

    A captured step needs experts without host synchronisation. transformers' default ``grouped_mm``
    computes the expert offsets on the device (``histc``) and runs one grouped GEMM, but that kernel takes
    bfloat16 only: in another dtype transformers falls back to a loop over the experts that reads the
    offsets back to the host, and ``experts_implementation="eager"`` reads the experts hit (``nonzero``).
    Both still run (and give the same tokens) on the eager engine.
    """

    def step_graph_blocker(self) -> str | None:
        implementation = getattr(self.text_model.config, "_experts_implementation", None) or "grouped_mm"
        if implementation != "grouped_mm":
            return (f"experts_implementation={implementation!r} reads the experts hit back to the host; "
                    "'grouped_mm' (transformers' default) captures")
        if self.dtype != torch.bfloat16:
            return (f"transformers' grouped_mm experts run as one kernel in bfloat16 only; in {self.dtype} they loop "
                    "over the experts with a host read")
        return super().step_graph_blocker()
