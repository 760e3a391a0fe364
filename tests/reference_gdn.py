"""A slow, obviously correct reference of Raincheck on Qwen3.5 (hybrid GDN + full attention).

What the engine must compute, written without its machinery: every row of the conversation is
rebuilt the way stock transformers would (embeddings with all images and videos scattered in,
`get_rope_index` over the whole conversation), and given

- its **order key** ``(turn, segment, place)`` with segment 0 = input (T ∪ S), 1 = deferred,
  2 = generated (place: the source position, deferred rows in restoration order,
  `reference.restoration_place`): its place in the logical physical order of docs/method.md §3;
- its **forward**: when it was computed (turn k's prefill, decode step i, or idle time), read
  from the traces.

Then the forwards are replayed one by one, layer by layer. A row computed in forward f sees, in
every layer, exactly the rows *computed by forward f* whose key is not larger than its own, with
the per-layer inputs those rows had *when they were computed* (nothing is recomputed):

- full-attention layers: explicit softmax attention over those rows' recorded keys and values
  (Qwen3.5's gated attention: q/k RMS norms, partial M-RoPE at original positions, a sigmoid
  output gate);
- Gated DeltaNet layers: the short causal convolution over those rows' recorded pre-conv inputs
  in key order (zeros before the first row), then the delta rule token by token,
  ``S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S / sqrt(dk)``, from a zero state.

For a GDN layer this *is* docs/method.md §4's join with recorded factors, applied directly: the
suffix's inputs are fixed when they are computed, inserted deferred rows change the state at the
boundary and the conv windows of the first ``Kc - 1`` suffix rows, and everything is rerun
tokenwise from the start instead of through ``M``. (It differs from a *full re-run*, in which the
suffix's inputs would also change through lower layers; `full_rerun_logits` is that re-run.)

This module uses no code of `raincheck_hf`: only the traces it reads and the model's own
submodules (projections, norms, MLPs, rotary tables).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference import TurnRecord, _cat, classify_rows, restoration_place, rope_index

__all__ = ["TurnRecord", "conversation_rows", "full_rerun_logits", "gdn_reference_logits"]


class Rows:
    """The conversation's rows: ``embeds [N, D]``, ``positions [3, N]``, ``segment``, ``turn``,
    ``forward`` (``[N]`` each), ``keep`` (rows that were ever computed) and, per turn, the rows whose
    logits the engine returned (forward 0 = prefill, then one per decode forward)."""

    def __init__(self, embeds, positions, turn, segment, forward, keep, logit_rows, place=None):
        self.embeds, self.positions = embeds, positions
        self.place = torch.arange(embeds.shape[0]) if place is None else place  # `reference.restoration_place`
        self.turn, self.segment, self.forward, self.keep = turn, segment, forward, keep
        self.logit_rows = logit_rows

    @property
    def order(self) -> torch.Tensor:
        """Kept rows in key order (turn, segment, source; deferred rows in restoration order)."""
        n = self.embeds.shape[0]
        ranked = sorted(range(n), key=lambda r: (int(self.turn[r]), int(self.segment[r]), int(self.place[r])))
        return torch.tensor([r for r in ranked if self.keep[r]])


def conversation_rows(model, turns: list[TurnRecord]) -> Rows:
    cfg = model.config
    text_model = model.model.language_model
    final = turns[-1].output.sequences[0, :-1]  # the last token was never fed back
    n_rows = final.shape[0]

    embeds = text_model.embed_tokens(final).clone()
    is_image, is_video = final == cfg.image_token_id, final == cfg.video_token_id
    for t in turns:
        answer = t.output.sequences[0, t.input_ids.shape[1]:]
        if bool(((answer == cfg.image_token_id) | (answer == cfg.video_token_id)).any()):
            raise ValueError("an answer holds an image/video placeholder token: pass suppress_tokens to generate.")
    for modality, values_key, grid_key, where in (
        ("image", "pixel_values", "image_grid_thw", is_image),
        ("video", "pixel_values_videos", "video_grid_thw", is_video),
    ):
        values = _cat([getattr(t, values_key) for t in turns])
        if values is None:
            continue
        grids = _cat([getattr(t, grid_key) for t in turns])
        fn = model.model.get_image_features if modality == "image" else model.model.get_video_features
        embeds[where] = torch.cat(list(fn(values, grids, return_dict=True).pooler_output))
    mm_types = is_image.long() + 2 * is_video.long()
    positions = rope_index(model, final, mm_types, turns)

    turn_of, segment, forward, keep = classify_rows(turns, n_rows)
    logit_rows = []
    for t in turns:
        prompt_len = t.input_ids.shape[1]
        end = t.output.sequences.shape[1] - 1
        n_forwards = len(t.output.logits) if t.output.logits is not None else end - prompt_len + 1
        logit_rows.append([prompt_len - 1] + [prompt_len + i - 1 for i in range(1, n_forwards)])
    return Rows(embeds, positions, turn_of, segment, forward, keep, logit_rows, restoration_place(turns, n_rows))


# ---- the layers, written out -------------------------------------------------------------------

def _rope(x, cos, sin):
    """Partial rotary embedding on the first ``cos.shape[-1]`` dims of ``x [H, n, hd]``."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


class _AttentionRecord:
    def __init__(self, n_rows, kv_heads, head_dim, dtype):
        self.k = torch.zeros(kv_heads, n_rows, head_dim, dtype=dtype)
        self.v = torch.zeros(kv_heads, n_rows, head_dim, dtype=dtype)


def _attention(attn, h, rows_new, cos, sin, record, visible):
    """Qwen3.5 gated attention for the new rows ``h [n, D]`` over every row ``visible [n, N]`` allows."""
    hd, n = attn.head_dim, h.shape[0]
    q, gate = torch.chunk(attn.q_proj(h).view(n, -1, 2 * hd), 2, dim=-1)  # [n, H, hd] each
    gate = gate.reshape(n, -1)
    q = attn.q_norm(q).transpose(0, 1)  # [H, n, hd]
    k = attn.k_norm(attn.k_proj(h).view(n, -1, hd)).transpose(0, 1)
    v = attn.v_proj(h).view(n, -1, hd).transpose(0, 1)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    record.k[:, rows_new], record.v[:, rows_new] = k, v
    groups = q.shape[0] // record.k.shape[0]
    keys = record.k.repeat_interleave(groups, dim=0)  # [H, N, hd]
    values = record.v.repeat_interleave(groups, dim=0)
    scores = (q @ keys.transpose(-1, -2)) * hd**-0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values  # [H, n, hd]
    out = out.transpose(0, 1).reshape(n, -1) * torch.sigmoid(gate)
    return attn.o_proj(out)


class _GDNRecord:
    def __init__(self, n_rows, conv_dim, heads, dtype):
        self.qkv = torch.zeros(n_rows, conv_dim, dtype=dtype)
        self.a = torch.zeros(n_rows, heads, dtype=dtype)
        self.b = torch.zeros(n_rows, heads, dtype=dtype)


class _PrefixStates:
    """Memo of one GDN stream: the rows of the last sequence run and the state after each of them.

    The state after a prefix depends only on the prefix's rows and their recorded inputs (recorded
    once, never changed), so a new sequence restarts from the longest prefix it shares with the
    last one instead of from zero. Purely a speed-up: ``memo=None`` reruns everything.
    """

    def __init__(self):
        self.rows: list[int] = []
        self.states: list[torch.Tensor] = []

    def shared(self, sequence: list[int]) -> int:
        n = 0
        for a, b in zip(self.rows, sequence):
            if a != b:
                break
            n += 1
        return n


def _delta_rule_outputs(gdn, record, sequence, memo: _PrefixStates | None = None):
    """Conv + delta rule over ``sequence`` (row ids in key order); outputs ``[len, HV, dv]``
    (rows restored from ``memo`` are not recomputed and their outputs are left undefined)."""
    kc = gdn.conv_kernel_size
    x = record.qkv[sequence]  # [T, C] pre-conv inputs, as recorded
    w = gdn.conv1d.weight[:, 0]  # [C, Kc]
    padded = torch.cat([x.new_zeros(kc - 1, x.shape[1]), x])
    conv = sum(w[:, j] * padded[j:j + x.shape[0]] for j in range(kc))  # out_t = sum_j w_j x_{t-Kc+1+j}
    if gdn.conv1d.bias is not None:
        conv = conv + gdn.conv1d.bias
    conv = F.silu(conv)
    q, k, v = torch.split(conv, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    t_len, rep = x.shape[0], gdn.num_v_heads // gdn.num_k_heads

    def l2(z):
        return z * torch.rsqrt((z * z).sum(-1, keepdim=True) + 1e-6)

    q = l2(q.reshape(t_len, gdn.num_k_heads, gdn.head_k_dim).float()).repeat_interleave(rep, dim=1)
    k = l2(k.reshape(t_len, gdn.num_k_heads, gdn.head_k_dim).float()).repeat_interleave(rep, dim=1)
    v = v.reshape(t_len, gdn.num_v_heads, gdn.head_v_dim).float()
    beta = record.b[sequence].sigmoid().float()
    g = -gdn.A_log.float().exp() * F.softplus(record.a[sequence].float() + gdn.dt_bias)
    state = torch.zeros(gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
    out = torch.zeros(t_len, gdn.num_v_heads, gdn.head_v_dim)
    scale = gdn.head_k_dim**-0.5
    seq_list = sequence.tolist()
    start, states = 0, []
    if memo is not None:
        start = memo.shared(seq_list)
        states = memo.states[:start]
        if start:
            state = states[-1]
    for t in range(start, t_len):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = scale * torch.einsum("hk,hkv->hv", q[t], state)
        states.append(state)
    if memo is not None:
        memo.rows, memo.states = seq_list, states
    return out


def _gdn(gdn, h, rows_new, record, streams, memos):
    """GDN outputs for the new rows ``h [n, D]``.

    ``streams``: ``(sequence, members)`` pairs; ``sequence`` holds row ids in key order and, for each
    new-row index ``i`` in ``members``, row ``rows_new[i]``'s visible rows are the prefix of
    ``sequence`` that ends with it (the recurrence is causal, so one pass serves all of them).
    """
    n = h.shape[0]
    record.qkv[rows_new] = gdn.in_proj_qkv(h)
    record.a[rows_new] = gdn.in_proj_a(h)
    record.b[rows_new] = gdn.in_proj_b(h)
    z = gdn.in_proj_z(h).view(n, gdn.num_v_heads, gdn.head_v_dim)
    core = torch.empty(n, gdn.num_v_heads, gdn.head_v_dim, dtype=h.dtype)
    for (sequence, members), memo in zip(streams, memos):
        if not members:
            continue
        outs = _delta_rule_outputs(gdn, record, sequence, memo)
        where = {int(row): j for j, row in enumerate(sequence)}
        for i in members:
            core[i] = outs[where[int(rows_new[i])]].to(h.dtype)
    normed = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return gdn.out_proj(normed.reshape(n, -1))


@torch.no_grad()
def gdn_reference_logits(model, turns: list[TurnRecord], gdn_sees_deferred: bool = True):
    """Per turn, the reference logits ``[V]`` of each of its forwards (0 = prefill).

    ``gdn_sees_deferred=False`` is an ablation for tests: non-deferred rows' GDN sequences skip the
    deferred rows (attention still sees them), to show that the GDN part of the method matters.
    """
    rows = conversation_rows(model, turns)
    text_model = model.model.language_model
    cfg = text_model.config
    order = rows.order
    n_rows, dtype = rows.embeds.shape[0], rows.embeds.dtype
    rank = torch.full((n_rows,), -1, dtype=torch.long)
    rank[order] = torch.arange(order.numel())

    cos_all, sin_all = text_model.rotary_emb(rows.embeds[None], rows.positions[:, None, :])
    records = []
    for layer, kind in zip(text_model.layers, cfg.layer_types):
        if kind == "linear_attention":
            g = layer.linear_attn
            records.append(_GDNRecord(n_rows, g.conv_dim, g.num_v_heads, dtype))
            records[-1].memos = (_PrefixStates(), _PrefixStates())  # one per stream
        else:
            records.append(_AttentionRecord(n_rows, cfg.num_key_value_heads, layer.self_attn.head_dim, dtype))

    final_hidden = torch.zeros_like(rows.embeds)
    computed = torch.zeros(n_rows, dtype=torch.bool)
    for f in sorted(set(rows.forward[order].tolist())):
        new = order[rows.forward[order] == f]  # key order
        computed[new] = True
        by_key = order[computed[order]]  # every row computed so far, key order
        # a row sees the computed rows up to itself in key order: a prefix of by_key
        visible = computed[None, :] & (rank[None, :] <= rank[new][:, None])  # [n, N]
        upto = by_key[rank[by_key] <= rank[new].max()]
        is_deferred = rows.segment[new] == 1
        if gdn_sees_deferred:
            streams = [(upto, list(range(new.numel())))]
        else:
            streams = [(upto, is_deferred.nonzero().flatten().tolist()),
                       (upto[rows.segment[upto] != 1], (~is_deferred).nonzero().flatten().tolist())]
        cos, sin = cos_all[0, new], sin_all[0, new]

        hidden = rows.embeds[new]
        for layer, kind, record in zip(text_model.layers, cfg.layer_types, records):
            h = layer.input_layernorm(hidden)
            if kind == "linear_attention":
                mixed = _gdn(layer.linear_attn, h, new, record, streams, record.memos)
            else:
                mixed = _attention(layer.self_attn, h, new, cos, sin, record, visible)
            hidden = hidden + mixed
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden)[None])[0]  # MoE blocks want [B, L, D]
        final_hidden[new] = text_model.norm(hidden)

    logits = model.lm_head(final_hidden)
    return [[logits[r] for r in per_turn] for per_turn in rows.logit_rows]


@torch.no_grad()
def full_rerun_logits(model, turns: list[TurnRecord]):
    """The stock model on the final logical sequence (kept rows in key order, original positions),
    one causal forward: what re-prefilling everything would give. Same layout as the reference."""
    rows = conversation_rows(model, turns)
    order = rows.order
    text_model = model.model.language_model
    hidden = text_model(inputs_embeds=rows.embeds[order][None], position_ids=rows.positions[:, order][:, None],
                        use_cache=False).last_hidden_state[0]
    logits = model.lm_head(hidden)
    rank = torch.full((rows.embeds.shape[0],), -1, dtype=torch.long)
    rank[order] = torch.arange(order.numel())
    return [[logits[rank[r]] for r in per_turn] for per_turn in rows.logit_rows]
