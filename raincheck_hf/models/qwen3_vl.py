"""Qwen3-VL through public seams: the vision tower's outputs, input embeddings, explicit 3-D
positions, DeepStack arguments of the text model, a 4-D mask and the cache layer API.

Nothing here copies modeling code. One forward over arbitrary rows is a call of the text model
(`model.model.language_model`) with ``inputs_embeds``, ``position_ids`` of shape ``[3, 1, L]``
(M-RoPE t/h/w), ``visual_pos_masks``/``deepstack_visual_embeds`` restricted to the rows of this
forward (so DeepStack features are added only for the visual rows actually prefilled), and a
4-D mask, which transformers passes to attention untouched.
"""

from __future__ import annotations

import torch

from ..masking import check_attention_implementation, visibility_to_attention_mask
from ..selection import Segment
from .base import RowBatch, TurnInputs, accelerate_split, execution_device  # noqa: F401 (older imports)


class Qwen3VLAdapter:
    model_classes = ("Qwen3VLForConditionalGeneration",)
    supports_fast_path = True  # every text layer is attention: all state fits `StaticDeferredCache`

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.text_model = model.model.language_model
        self.lm_head = model.lm_head
        self.image_token_id = self.config.image_token_id
        self.video_token_id = self.config.video_token_id
        self._non_question_ids = torch.tensor(
            [self.image_token_id, self.video_token_id, self.config.vision_start_token_id,
             self.config.vision_end_token_id]
        )

    # ---- properties -----------------------------------------------------------------------
    @property
    def attn_implementation(self) -> str:
        return self.text_model.config._attn_implementation

    def check_attention(self) -> str:
        return check_attention_implementation(self.attn_implementation)

    @property
    def device(self) -> torch.device:
        """Where the engine builds a forward's rows: the input embedding's *execution* device.

        Not ``embed_tokens.weight.device``: under accelerate's cpu / disk offload that weight sits on
        ``meta`` between forwards and the hook moves it to its execution device only inside the call.
        """
        return execution_device(self.text_model.embed_tokens)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_model.embed_tokens.weight.dtype

    def text_config(self):
        return self.config.text_config

    def placeholder_masks(self, input_ids: torch.Tensor, text_prefix: int = 0):
        """``(is_image, is_video)`` over ``input_ids``, the first ``text_prefix`` rows counted as text."""
        is_image, is_video = input_ids == self.image_token_id, input_ids == self.video_token_id
        if text_prefix:
            is_image[:text_prefix] = False
            is_video[:text_prefix] = False
        return is_image, is_video

    def multimodal_mask(self, input_ids: torch.Tensor, text_prefix: int = 0) -> torch.Tensor:
        is_image, is_video = self.placeholder_masks(input_ids, text_prefix)
        return is_image | is_video

    # ---- encoding -------------------------------------------------------------------------
    def _vision_outputs(self, modality, mm_encoder_outputs, pixel_values, grid, vision_graphs=None):
        out = (mm_encoder_outputs or {}).get(modality)
        if out is None and pixel_values is not None:
            if vision_graphs is not None:  # the fast path's tower: same outputs, replayed per grid
                return vision_graphs.encode(pixel_values, grid)
            encode = self.model.model.get_image_features if modality == "image" else self.model.model.get_video_features
            out = encode(pixel_values, grid, return_dict=True)
        return out

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
    ) -> TurnInputs:
        """Embed one turn's new tokens ``input_ids [L]`` and compute their absolute 3-D positions.

        The first ``text_prefix`` rows are text whatever their ids: the previous answer's last token
        (generated, never fed back yet) is text even if a model happened to emit a placeholder id.
        ``vision_graphs`` (a `fast.vision_graphs.VisionGraphs` of this model's tower) encodes the pixels
        instead of ``get_image_features`` / ``get_video_features``.
        """
        device = self.device
        ids = input_ids.to(device)
        embeds = self.text_model.embed_tokens(ids)
        is_image, is_video = self.placeholder_masks(ids, text_prefix)
        is_visual = is_image | is_video
        n_visual = int(is_visual.sum())

        # visual features in source order (images and videos may interleave)
        feats = embeds.new_zeros(n_visual, embeds.shape[-1])
        deepstack = None
        image_pos = is_image[is_visual]
        for modality, mask_rows, values, grid in (
            ("image", is_image, pixel_values, image_grid_thw),
            ("video", is_video, pixel_values_videos, video_grid_thw),
        ):
            n_rows = int(mask_rows.sum())
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
            where = image_pos if modality == "image" else ~image_pos
            feats[where] = pooled
            if out.deepstack_features is not None:
                if deepstack is None:
                    deepstack = [embeds.new_zeros(n_visual, embeds.shape[-1]) for _ in out.deepstack_features]
                for layer, feat in zip(deepstack, out.deepstack_features):
                    layer[where] = torch.cat(list(feat)).to(device, embeds.dtype)
        embeds = embeds.clone()
        embeds[is_visual] = feats
        visual_index = torch.full_like(ids, -1)
        visual_index[is_visual] = torch.arange(n_visual, device=device)

        # absolute 3-D positions: the model's own rope index on this turn, shifted to continue
        mm_types = is_image.long() + 2 * is_video.long()
        positions, _ = self.model.model.get_rope_index(
            ids[None], mm_types[None], image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw
        )
        positions = positions[:, 0].to(device) + position_offset
        next_position = int(positions.max()) + 1 if positions.numel() else position_offset

        segments = self._segments(ids, is_visual, is_image, feats, deepstack, image_grid_thw, video_grid_thw)
        question = ~torch.isin(ids, self._non_question_ids.to(device))
        question[:text_prefix] = False
        return TurnInputs(ids, embeds, positions, visual_index, deepstack, segments,
                          question.nonzero().flatten(), next_position)

    def _segments(self, ids, is_visual, is_image, feats, deepstack, image_grid_thw, video_grid_thw):
        """Maximal runs of placeholder rows: one per image, one per video temporal slice."""
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
        # a segment starts where the rows stop being contiguous or the modality changes
        starts = torch.ones(rows.numel(), dtype=torch.bool)
        if rows.numel() > 1:
            starts[1:] = (rows[1:] != rows[:-1] + 1) | (row_is_image[1:] != row_is_image[:-1])
        bounds = starts.nonzero().flatten().tolist() + [rows.numel()]
        segments = []
        counters = {"image": 0, "video": 0}
        for start, end in zip(bounds[:-1], bounds[1:]):
            modality = "image" if bool(row_is_image[start]) else "video"
            grid_list = grids[modality]
            grid = grid_list[counters[modality]] if counters[modality] < len(grid_list) else (1, 1, end - start)
            counters[modality] += 1
            vis = torch.arange(start, end, device=feats.device)
            extras = {} if deepstack is None else {"deepstack": [d[vis] for d in deepstack]}
            segments.append(Segment(len(segments), modality, feats[vis], grid, rows[start:end].clone(), extras))
        return segments

    # ---- one forward over arbitrary rows --------------------------------------------------
    def rows(self, turn: TurnInputs, row_index: torch.Tensor) -> RowBatch:
        """The given rows of a turn as a batch (``row_index`` indexes the turn's rows)."""
        row_index = row_index.to(self.device)
        vis = turn.visual_index[row_index]
        visual = vis >= 0
        deepstack = None if turn.deepstack is None else [d[vis[visual]] for d in turn.deepstack]
        return RowBatch(turn.embeds[row_index], turn.positions[:, row_index], visual, deepstack)

    def forward(self, cache, batch: RowBatch, visible: torch.Tensor | None, want_logits: bool = True, kinds=None):
        """Run ``batch`` through the text model on ``cache``; logits of its last row (``[1, V]``) or None.

        ``visible`` is the ``[L, n_rows]`` visibility from `DeferredDynamicCache.add_rows`; None means
        plain causal (a single decode token that sees every stored row). ``kinds`` (``[L]`` INPUT /
        DEFERRED / GENERATED; deferred rows always come first) is not needed by full attention.
        """
        mask = None
        if visible is not None:
            mask = visibility_to_attention_mask(visible.to(self.device), self.attn_implementation, self.dtype)
        has_visual = bool(batch.visual.any()) and batch.deepstack is not None
        out = self.text_model(
            inputs_embeds=batch.embeds[None],
            position_ids=batch.positions[:, None, :],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            visual_pos_masks=batch.visual[None] if has_visual else None,
            deepstack_visual_embeds=batch.deepstack if has_visual else None,
        )
        if not want_logits:
            return None
        return self.lm_head(out.last_hidden_state[:, -1:])[:, -1]

    def text_row(self, token_id: torch.Tensor, position: int) -> RowBatch:
        """A single text token (a generated one) at M-RoPE position ``position`` on all three axes."""
        device = self.device  # looked up once: it walks accelerate's hooks and the parameters (a decode step's host time)
        ids = token_id.reshape(1).to(device)
        pos = torch.full((3, 1), position, dtype=torch.long, device=device)
        return RowBatch(self.text_model.embed_tokens(ids), pos, torch.zeros(1, dtype=torch.bool, device=device), None)

    def pending_batch(self, pending) -> RowBatch:
        return RowBatch(pending.embeds, pending.positions, torch.ones(len(pending), dtype=torch.bool,
                        device=self.device), pending.deepstack)
