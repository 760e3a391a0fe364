"""The slow, obviously correct reference of docs/method.md §3 for whole conversations.

Given what each `generate` call returned, rebuild every row of the conversation the way stock
transformers would for a full re-tokenised conversation (embeddings with all images scattered in,
`get_rope_index` over the whole sequence, DeepStack features per visual row), put the rows in the
logical physical order ``[T∪S] [deferred, in restoration order] [generated]`` per turn, and run **one** forward of the
stock text model with the visibility "earlier in that order and already computed". Its logits at
each decode row are what the incremental engine must reproduce.

This module uses no code of `raincheck_hf` except the trace it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BIG = 10**6


@dataclass
class TurnRecord:
    input_ids: torch.Tensor  # what was passed to generate: the whole conversation so far, [1, P]
    output: object  # the RaincheckGenerateOutput
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None  # Qwen2.5-VL's processor, for videos


def _cat(xs):
    xs = [x for x in xs if x is not None]
    return torch.cat(xs) if xs else None


def rope_index(model, ids, mm_types, turns: list[TurnRecord]) -> torch.Tensor:
    """``[3, N]``: the model's own ``get_rope_index`` over the whole conversation (``second_per_grid_ts``
    where the model's processor gave it)."""
    extra = {}
    seconds = _cat([t.second_per_grid_ts for t in turns])
    if seconds is not None:
        extra["second_per_grid_ts"] = seconds
    positions, _ = model.model.get_rope_index(
        ids[None], mm_types[None],
        image_grid_thw=_cat([t.image_grid_thw for t in turns]),
        video_grid_thw=_cat([t.video_grid_thw for t in turns]),
        **extra,
    )
    return positions[:, 0]


def classify_rows(turns: list[TurnRecord], n_rows: int):
    """``(turn_of, segment, forward, keep)``, each ``[n_rows]``, of the conversation's rows: the turn, the segment (0
    input, 1 deferred, 2 generated), the forward that wrote it (``turn * BIG + index``) and whether the cache holds
    it (a dropped row or one still pending at the end does not)."""
    starts = [0] + [t.output.sequences.shape[1] - 1 for t in turns[:-1]]
    segment = torch.zeros(n_rows, dtype=torch.long)
    turn_of = torch.zeros(n_rows, dtype=torch.long)
    forward = torch.zeros(n_rows, dtype=torch.long)
    keep = torch.ones(n_rows, dtype=torch.bool)
    for k, t in enumerate(turns):
        prompt_len = t.input_ids.shape[1]
        end = t.output.sequences.shape[1] - 1
        trace = t.output.raincheck
        turn_of[starts[k]:end] = k
        forward[starts[k]:prompt_len] = k * BIG
        gen = torch.arange(prompt_len, end)
        segment[gen] = 2
        forward[gen] = k * BIG + (gen - prompt_len + 1)
        for p in trace.deferred.tolist():
            segment[p] = 1
            forward[p] = k * BIG + (BIG - 1)  # restored in idle time after the answer unless a trace says otherwise
        for i, restored in enumerate(trace.restored_per_forward):
            forward[restored] = k * BIG + i  # forward 0 of turn k restores earlier turns' leftovers
        keep[trace.dropped] = False
    keep[turns[-1].output.raincheck.pending] = False
    return turn_of, segment, forward, keep


def restoration_place(turns: list[TurnRecord], n_rows: int) -> torch.Tensor:
    """``[n_rows]`` each row's place within its segment of the physical order: its source position, except
    that a turn's deferred rows go in the order they were restored (``RaincheckConfig.restore_order``): those
    its trace restored during the answer, then those still pending when the call returned (restored later,
    in that order). Source order when the trace restored them in source order."""
    place = torch.arange(n_rows)
    for t in turns:
        trace = t.output.raincheck
        restored = [r for r in trace.restored_per_forward[1:]] + [trace.pending]
        rows = torch.cat([r.reshape(-1).long() for r in restored]) if restored else torch.empty(0, dtype=torch.long)
        deferred = trace.deferred.reshape(-1).long()
        if trace.dropped.numel():
            continue  # hard: nothing restored
        assert sorted(rows.tolist()) == sorted(deferred.tolist()), "every deferred row is restored exactly once"
        place[rows] = deferred.sort().values[: rows.numel()]  # the k-th restored row takes the k-th place
    return place


def reference_logits(model, turns: list[TurnRecord]) -> list[list[torch.Tensor]]:
    """Per turn, the reference logits ``[V]`` of each of its forwards (0 = prefill)."""
    cfg = model.config
    final = turns[-1].output.sequences[0, :-1]  # the last token was never fed back
    n_rows = final.shape[0]

    # stock embedding of the whole conversation
    text_model = model.model.language_model
    embeds = text_model.embed_tokens(final).clone()
    is_image, is_video = final == cfg.image_token_id, final == cfg.video_token_id
    is_visual = is_image | is_video
    n_vis = int(is_visual.sum())
    vis_feats = embeds.new_zeros(n_vis, embeds.shape[-1])
    deepstack = None
    where_image = is_image[is_visual]
    for modality, values_key, grid_key, where in (
        ("image", "pixel_values", "image_grid_thw", where_image),
        ("video", "pixel_values_videos", "video_grid_thw", ~where_image),
    ):
        values = _cat([getattr(t, values_key) for t in turns])
        grids = _cat([getattr(t, grid_key) for t in turns])
        if values is None:
            continue
        fn = model.model.get_image_features if modality == "image" else model.model.get_video_features
        out = fn(values, grids, return_dict=True)
        vis_feats[where] = torch.cat(list(out.pooler_output))
        features = getattr(out, "deepstack_features", None)  # Qwen3-VL's DeepStack; other towers have none
        if not features:
            continue
        if deepstack is None:
            deepstack = [embeds.new_zeros(n_vis, embeds.shape[-1]) for _ in features]
        for layer, feat in zip(deepstack, features):
            layer[where] = torch.cat(list(feat))
    embeds[is_visual] = vis_feats
    mm_types = is_image.long() + 2 * is_video.long()
    positions = rope_index(model, final, mm_types, turns)

    turn_of, segment, fwd, keep = classify_rows(turns, n_rows)

    place = restoration_place(turns, n_rows)
    order = sorted(range(n_rows), key=lambda r: (int(turn_of[r]), int(segment[r]), int(place[r])))
    order = torch.tensor([r for r in order if keep[r]])
    rank = torch.empty(n_rows, dtype=torch.long)
    rank[order] = torch.arange(order.numel())
    f = fwd[order]
    visible = (torch.arange(order.numel())[None, :] <= torch.arange(order.numel())[:, None]) & (f[None, :] <= f[:, None])

    impl = text_model.config._attn_implementation
    mask = visible[None, None].to(embeds.device)
    if impl == "eager":
        mask = torch.where(mask, 0.0, torch.finfo(embeds.dtype).min).to(embeds.dtype)
    vis_rows = is_visual[order]
    ordinal = torch.cumsum(is_visual.long(), 0) - 1
    ds = None if deepstack is None else [d[ordinal[order][vis_rows]] for d in deepstack]
    deepstack_kwargs = {} if ds is None else {"visual_pos_masks": vis_rows[None], "deepstack_visual_embeds": ds}
    hidden = text_model(
        inputs_embeds=embeds[order][None], position_ids=positions[:, order][:, None], attention_mask=mask,
        use_cache=False, **deepstack_kwargs,
    ).last_hidden_state[0]
    logits = model.lm_head(hidden)

    result = []
    for k, t in enumerate(turns):
        prompt_len = t.input_ids.shape[1]
        n_forwards = len(t.output.logits)
        rows = [prompt_len - 1] + [prompt_len + i - 1 for i in range(1, n_forwards)]
        result.append([logits[rank[r]] for r in rows])
    return result
