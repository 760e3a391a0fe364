"""`fast.attention.few_query_attention` computes what stock SDPA computes (its reference), on random inputs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from raincheck_hf import RaincheckConfig
from raincheck_hf.fast import attention

from conftest import INPUT_CASES, make_inputs


def _inputs(seed, heads, kv_heads, rows, slots, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, rows, dim, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, slots, dim, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, slots, dim, generator=g).to(dtype)
    visible = torch.rand(rows, slots, generator=g) < 0.6
    visible[:, 0] = True  # every row sees something (a fast-path padding row sees every real row)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    return module, q, k, v, visible[None, None]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_few_query_attention_matches_sdpa(heads, kv_heads, rows):
    module, q, k, v, mask = _inputs(rows * 10 + heads, heads, kv_heads, rows, slots=97)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = attention.few_query_attention(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (1, rows, heads, 16)
    assert (got - want).abs().max().item() <= 1e-5


def test_few_query_attention_in_bfloat16_stays_close_to_float32_sdpa():
    module, q, k, v, mask = _inputs(7, 8, 2, 1, slots=300, dim=64)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=64 ** -0.5)
    got, _ = attention.few_query_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask,
                                           scaling=64 ** -0.5)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 2e-2


def test_many_rows_and_unsupported_masks_go_to_stock_sdpa():
    module, q, k, v, mask = _inputs(3, 4, 2, attention.FEW_QUERY_MAX + 1, slots=80)
    assert torch.equal(attention.few_query_attention(module, q, k, v, mask)[0],
                       sdpa_attention_forward(module, q, k, v, mask)[0])
    module, q, k, v, mask = _inputs(4, 4, 2, 3, slots=40)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert torch.equal(attention.few_query_attention(module, q, k, v, additive)[0],
                       sdpa_attention_forward(module, q, k, v, additive)[0])


def test_the_backend_is_switched_only_inside_the_step_and_only_for_its_thread(model, eager_model):
    import threading

    from raincheck_hf.fast.scoping import step_scope

    text_model = model.model.language_model
    attn = text_model.layers[0].self_attn
    seen_elsewhere = []
    with pytest.raises(RuntimeError):
        with step_scope(text_model, []):
            assert attn.config._attn_implementation == attention.NAME  # what the layer reads in this thread
            assert text_model.config._attn_implementation == "sdpa"  # the model's config is never switched
            other = threading.Thread(target=lambda: seen_elsewhere.append(attn.config._attn_implementation))
            other.start()
            other.join()
            raise RuntimeError("a failing step")
    assert seen_elsewhere == ["sdpa"]
    assert attn.config is text_model.config  # the view is gone with the last step
    eager = eager_model.model.language_model
    with step_scope(eager, []):
        assert eager.layers[0].self_attn.config._attn_implementation == "eager"  # only sdpa models get it


def test_fast_path_steps_use_it_and_the_eager_engine_does_not(model, processor, monkeypatch):
    calls = []
    original = attention.few_query_attention

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "few_query_attention", counting)
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME, counting)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    model.generate(**inputs, raincheck=RaincheckConfig(fast_path=False, chunk_size=4, decode_guard=2), **kw)
    assert calls == []
    model.generate(**inputs, raincheck=RaincheckConfig(fast_path=True, chunk_size=4, decode_guard=2), **kw)
    layers = model.config.text_config.num_hidden_layers
    assert len(calls) == layers * 6  # the prefill and every decode forward, each layer
    assert 1 in calls and 5 in calls  # plain decode steps and fused [chunk of 4, token] steps


def _batched_views(seed, batch, heads, kv_heads, rows, slots, capacity, dim=16, dtype=torch.float32, device="cpu"):
    """A batched step's inputs as the slot pool hands them over: keys / values are views ``[:batch, :, :slots]`` of
    larger ``[slots_total, Hkv, capacity, D]`` tensors, each sequence with its own visibility."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, dim, generator=g).to(device, dtype)
    k_pool = torch.randn(batch + 2, kv_heads, capacity, dim, generator=g).to(device, dtype)
    v_pool = torch.randn(batch + 2, kv_heads, capacity, dim, generator=g).to(device, dtype)
    visible = torch.rand(batch, 1, rows, slots, generator=g) < 0.6
    visible[..., 0] = True
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    return module, q, k_pool[:batch, :, :slots], v_pool[:batch, :, :slots], visible.to(device)


@pytest.mark.parametrize("rows", [1, 8])
def test_few_query_attention_of_a_batch_over_pool_views_matches_sdpa(rows):
    module, q, k, v, mask = _batched_views(rows, 3, 8, 2, rows, slots=50, capacity=64)
    assert not k.is_contiguous()
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = attention.few_query_attention(module, q, k, v, mask, scaling=0.25)
    assert (got - want).abs().max().item() <= 1e-5


def test_low_precision_reads_fall_back_to_the_upcast_form_off_cuda():
    """On the CPU (no ``bmm`` with ``out_dtype`` there) asking for half-precision reads gives the upcast form."""
    module, q, k, v, mask = _batched_views(5, 2, 4, 2, 3, slots=30, capacity=40, dtype=torch.bfloat16)
    assert not attention.low_precision_scores(q, k)
    assert torch.equal(attention._few_query(q, k, v, mask, 0.25, low_precision_reads=True),
                       attention._few_query(q, k, v, mask, 0.25, low_precision_reads=False))


def test_split_count_and_row_blocks():
    assert attention.split_count(programs=8, slots=2112, processors=132) == 33  # 2 waves over 8 programs
    assert attention.split_count(programs=512, slots=2112, processors=132) == 1
    assert attention.split_count(programs=1, slots=100, processors=132) == 2  # at most one split per 64-slot tile
    assert [attention._block_m(n) for n in (1, 4, 16, 17, 64, 128)] == [16, 16, 16, 32, 64, 64]


def run_in_interpreter(script: str, cases: list) -> dict:
    """``script`` (it prints one JSON line last) over ``cases`` in a fresh process under Triton's interpreter
    (``TRITON_INTERPRET=1`` is read when Triton compiles a kernel, so it must be set before the first one); its
    results, one per case. Skips without Triton."""
    import os
    import subprocess
    import sys

    from raincheck_hf._triton import triton_available

    if not triton_available():
        pytest.skip("needs Triton (its interpreter runs the kernel on CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


TRITON_SCRIPT = r"""
import json, sys, torch
from types import SimpleNamespace
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from raincheck_hf.fast import attention
out = {}
for b, hq, hkv, rows, slots, cap, d, bcast in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(b * 1000 + rows * 10 + slots)
    q = torch.randn(b, hq, rows, d, generator=g)
    k = torch.randn(b + 1, hkv, cap, d, generator=g)[:b, :, :slots]  # pool views, as the batched steps read
    v = torch.randn(b + 1, hkv, cap, d, generator=g)[:b, :, :slots]
    visible = torch.rand(1 if bcast else b, 1, rows, slots, generator=g) < 0.5
    visible[..., 0] = True
    visible[..., 0, 70:] = False  # a row that sees nothing in the later splits
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    usable = attention.triton_usable(q, k, v, visible)
    got = attention._few_query_triton(q, k, v, visible, 0.3)
    want, _ = sdpa_attention_forward(module, q, k, v, visible, scaling=0.3)
    routed, _ = attention.few_query_attention(module, q, k, v, visible, scaling=0.3)
    out[str([b, hq, hkv, rows, slots])] = {"usable": usable, "err": (got - want).abs().max().item(),
                                           "routed": torch.equal(routed, got), "shape": list(got.shape)}
print(json.dumps(out))
"""


def test_triton_kernel_matches_sdpa_in_the_interpreter():
    """The Triton kernel (`fast._triton_attention`) in Triton's interpreter on CPU (fp32, IEEE products): decode
    and chunk-sized row counts, GQA groups of 1 to 4, several row blocks (4 x 20 = 80 rows), several slot splits
    (a row that sees nothing in some), a mask shared by the batch, key / value views of a larger pool; within 1e-5
    of stock SDPA, and `few_query_attention` routes to it."""
    cases = [(1, 4, 2, 1, 97, 128, 16, False), (3, 8, 2, 5, 150, 160, 32, False), (2, 8, 2, 20, 200, 256, 16, True),
             (2, 4, 4, 1, 33, 40, 16, False), (1, 8, 2, 32, 130, 130, 64, False)]
    results = run_in_interpreter(TRITON_SCRIPT, cases)
    for name, r in results.items():
        assert r["usable"] and r["routed"] and r["err"] <= 1e-5, (name, r)


EXTENT_SCRIPT = r"""
import json, sys, torch
from types import SimpleNamespace
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from raincheck_hf.fast import attention
from raincheck_hf.fast.context import STEP, StepScope
out = {}
for b, hq, hkv, rows, slots, d in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(b * 100 + rows + slots)
    q = torch.randn(b, hq, rows, d, generator=g)
    k = torch.randn(b, hkv, slots, d, generator=g)
    v = torch.randn(b, hkv, slots, d, generator=g)
    # each sequence's rows at start .. start + rows - 1, seeing a random part of the slots below and themselves
    starts = torch.randint(0, slots - rows + 1, (b,), generator=g)
    starts[0] = 0  # (a sequence whose extent ends inside the first split)
    starts[-1] = slots - rows  # (one as long as the span)
    extent = starts + rows
    col = torch.arange(slots)
    write = starts[:, None] + torch.arange(rows)
    visible = (torch.rand(b, 1, rows, slots, generator=g) < 0.6) & (col[None, None, None] < write[:, None, :, None])
    visible |= col[None, None, None] == write[:, None, :, None]
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    whole = attention._few_query_triton(q, k, v, visible, 0.3)
    bounded = attention._few_query_triton(q, k, v, visible, 0.3, extent)
    want, _ = sdpa_attention_forward(module, q, k, v, visible, scaling=0.3)
    with STEP.using(StepScope(frozenset(), {}, key_extent=extent)):
        routed, _ = attention.few_query_attention(module, q, k, v, visible, scaling=0.3)
    out[str([b, hq, hkv, rows, slots])] = {"same": torch.equal(whole, bounded), "routed": torch.equal(routed, bounded),
                                           "err": (bounded - want).abs().max().item()}
print(json.dumps(out))
"""


def test_the_triton_kernel_stops_at_each_sequences_key_extent():
    """A batched step's per-sequence key extents (`StepScope.key_extent`, routed by `few_query_attention`): the
    kernel walks each sequence's slots only up to its own rows, and the result is bit for bit the same as walking
    every slot (the slots skipped are ones its mask hides), within 1e-5 of SDPA; sequences ending inside the first
    split, in a middle one, and at the span, decode and chunk-sized rows, several splits."""
    cases = [(4, 8, 2, 1, 300, 16), (3, 4, 2, 32, 260, 16), (2, 4, 4, 5, 130, 32)]
    results = run_in_interpreter(EXTENT_SCRIPT, cases)
    for name, r in results.items():
        assert r["same"] and r["routed"] and r["err"] <= 1e-5, (name, r)


ROWS_SCRIPT = r"""
import json, sys, torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from types import SimpleNamespace
from raincheck_hf.fast import attention
from raincheck_hf.fast.context import STEP, StepScope
out = {}
for b, hq, hkv, rows, slots, d, real in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(b * 10 + rows + slots)
    q = torch.randn(b, hq, rows, d, generator=g)
    k = torch.randn(b, hkv, slots, d, generator=g)
    v = torch.randn(b, hkv, slots, d, generator=g)
    real = torch.tensor(real)  # each sequence's real rows (0: a padding sequence); the rest of ``rows`` is padding
    starts = torch.randint(0, slots - rows + 1, (b,), generator=g)
    extent = starts + rows
    col = torch.arange(slots)
    write = starts[:, None] + torch.arange(rows)
    visible = (torch.rand(b, 1, rows, slots, generator=g) < 0.6) & (col[None, None, None] < write[:, None, :, None])
    padding = torch.arange(rows)[None] >= real[:, None]  # [B, L]: a padding row sees only its own row
    visible = torch.where(padding[:, None, :, None], torch.zeros_like(visible), visible)
    visible |= col[None, None, None] == write[:, None, :, None]
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    every = attention._few_query_triton(q, k, v, visible, 0.3, extent)
    skipped = attention._few_query_triton(q, k, v, visible, 0.3, extent, real)
    want, _ = sdpa_attention_forward(module, q, k, v, visible, scaling=0.3)
    with STEP.using(StepScope(frozenset(), {}, key_extent=extent, query_rows=real)):
        routed, _ = attention.few_query_attention(module, q, k, v, visible, scaling=0.3)
    is_real = ~padding  # [B, L]
    block = attention._block_m((hq // hkv) * rows) // (hq // hkv)  # query positions per row block
    first = torch.arange(rows) // block * block  # [L] each position's block's first position
    dropped = first[None] >= real[:, None]  # [B, L] rows in a block of padding only
    out[str([b, hq, hkv, rows, slots, real.tolist()])] = {
        "real_same": torch.equal(skipped[is_real], every[is_real]),
        "dropped_zero": bool((skipped[dropped] == 0).all()), "dropped": int(dropped.sum()),
        "finite": bool(torch.isfinite(skipped).all()), "routed": torch.equal(routed, skipped),
        "err": (skipped[is_real] - want[is_real]).abs().max().item()}
print(json.dumps(out))
"""


def test_the_triton_kernel_skips_blocks_of_padding_rows():
    """A batched step's per-sequence real query rows (`StepScope.query_rows`, routed by `few_query_attention`): a row
    block holding only a sequence's padding rows (every sequence padded to the step's widest) is not computed (its
    rows' output is 0, finite), every real row's output is bit for bit the one computed without the skip, within
    1e-5 of SDPA; one-token sequences beside 32-row chunks, a padding sequence (0 rows), several row blocks."""
    cases = [(4, 8, 2, 32, 200, 16, [1, 32, 0, 17]), (3, 8, 2, 8, 130, 16, [1, 8, 3]), (2, 4, 4, 1, 70, 16, [1, 0])]
    results = run_in_interpreter(ROWS_SCRIPT, cases)
    for name, r in results.items():
        assert r["real_same"] and r["dropped_zero"] and r["finite"] and r["routed"] and r["err"] <= 1e-5, (name, r)
    assert results[str([4, 8, 2, 32, 200, [1, 32, 0, 17]])]["dropped"] == 16 + 32 + 0  # (the 1- and 0-row ones)


def test_the_triton_kernel_is_not_used_on_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module, q, k, v, mask = _batched_views(5, 2, 4, 2, 3, slots=30, capacity=40)
    assert not attention.triton_usable(q, k, v, mask)


# ---- the kernel's tiles fit the device's shared memory (256-dim heads on a Hopper GPU) ----

H100_SHARED = 232_448  # a program's opt-in shared memory on an H100 / H200 (what Triton checks a launch against)
A100_SHARED = 166_912


def test_the_kernels_tiles_fit_the_devices_shared_memory():
    """`launch_tiles` keeps the first choice (64-slot tiles, 3 stages) for 128-dim heads, and picks tiles that fit for
    Qwen3.5's 256-dim heads: Triton refused 3 stages there on an H100 (233,472 bytes asked, the `shared_bytes`
    figure, against 232,448)."""
    assert attention.shared_bytes(256, 2, 64, 64, 3) == 233_472
    assert attention.launch_tiles(128, 2, 64, H100_SHARED) == (64, 3)
    assert attention.launch_tiles(128, 2, 64, A100_SHARED) == (64, 3)
    assert attention.launch_tiles(256, 2, 64, H100_SHARED) == (64, 2)
    assert attention.launch_tiles(256, 2, 16, H100_SHARED) == (64, 3)  # (a decode step's 16-row block fits)
    assert attention.launch_tiles(256, 4, 64, A100_SHARED) == (32, 1)
    assert attention.launch_tiles(256, 2, 64, None) == attention.TILE_CHOICES[0]  # (the interpreter: no limit)
    for d in (16, 32, 64, 128, 256):
        for itemsize in (2, 4):
            for block_m in (16, 32, 64):
                for limit in (A100_SHARED, H100_SHARED):
                    block_n, stages = attention.launch_tiles(d, itemsize, block_m, limit)
                    assert attention.shared_bytes(d, itemsize, block_m, block_n, stages) <= limit


def test_a_launch_refused_for_shared_memory_retries_with_smaller_tiles_and_keeps_them(monkeypatch):
    """Where Triton still refuses a launch for its shared memory (the estimate short on another Triton), the launch
    is retried with the next smaller tiles, which the key keeps from then on; nothing is left half-launched (a
    refused launch raises before it starts)."""
    pytest.importorskip("triton")
    from raincheck_hf.fast import _triton_attention as kernels

    launches = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_N, num_stages, **kwargs):
                launches.append((grid, BLOCK_N, num_stages, args[13]))  # (args[13]: SPLIT_LEN)
                if num_stages == 3:
                    raise kernels.OutOfResources(233_472, 232_448, "shared memory")
                args[6].zero_()  # O
                args[7].zero_()  # M
                args[8].fill_(1.0)  # L
            return launch

    monkeypatch.setattr(kernels, "few_query_split", Kernel())
    monkeypatch.setattr(attention, "_TILES", {})
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 4, 32, generator=g), torch.randn(2, 2, 300, 32, generator=g), torch.randn(2, 2, 300, 32,
                                                                                                           generator=g)
    mask = torch.ones(2, 1, 4, 300, dtype=torch.bool)
    out = attention._few_query_triton(q, k, v, mask, 0.3)
    assert out.shape == (2, 4, 8, 32)
    assert [(n, s) for _, n, s, _ in launches] == [(64, 3), (64, 2)]
    assert all(split_len % n == 0 for _, n, _, split_len in launches)
    assert attention._TILES == {(32, 4, 16, torch.device("cpu")): (64, 2)}
    launches.clear()
    attention._few_query_triton(q, k, v, mask, 0.3)
    assert [(n, s) for _, n, s, _ in launches] == [(64, 2)]  # (kept: no refused launch again)


TILES_SCRIPT = r"""
import json, sys, torch
from types import SimpleNamespace
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from raincheck_hf.fast import attention
out = {}
for b, hq, hkv, rows, slots, d in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(b * 100 + rows + slots + d)
    q = torch.randn(b, hq, rows, d, generator=g)
    k = torch.randn(b, hkv, slots, d, generator=g)
    v = torch.randn(b, hkv, slots, d, generator=g)
    visible = torch.rand(b, 1, rows, slots, generator=g) < 0.5
    visible[..., 0] = True
    module = SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True, training=False)
    want, _ = sdpa_attention_forward(module, q, k, v, visible, scaling=0.3)
    block_m = attention._block_m(hq // hkv * rows)
    errors = {}
    for tiles in attention.TILE_CHOICES:
        attention._TILES[(d, 4, block_m, q.device)] = tiles
        got = attention._few_query_triton(q, k, v, visible, 0.3)
        errors[str(list(tiles))] = (got - want).abs().max().item()
    out[str([b, hq, hkv, rows, slots, d])] = errors
print(json.dumps(out))
"""


def test_every_tile_choice_computes_the_same_attention_in_the_interpreter():
    """Each of `TILE_CHOICES` (the key tile decides the splits' lengths) within 3e-5 of SDPA in Triton's interpreter,
    Qwen3.5's head shape (4 query heads a key/value head, 256 dims) at a 32-row chunk step among them."""
    results = run_in_interpreter(TILES_SCRIPT, [(2, 16, 4, 32, 150, 256), (3, 8, 2, 5, 97, 32)])
    for name, errors in results.items():
        assert len(errors) == len(attention.TILE_CHOICES), (name, errors)
        assert max(errors.values()) <= 3e-5, (name, errors)  # (fp32 sums over 256 dims: ~1e-5 from SDPA's)


def test_the_compiled_core_takes_two_graphs_per_head_shape_for_every_row_and_slot_count():
    """Inside a compiled step (`StepScope.compiled_attention`) the attention's core runs compiled: one copy per head
    shape (`fast.compiled.compiled_copy`), its head counts static, whatever another head shape compiled before it, with
    one Dynamo graph for a single row (a decode step's) and one for several (a chunk step's, a short prompt's), each for
    every slot count (the keys a view of a larger storage, as the static cache gives them). Each result is the eager
    form's."""
    from raincheck_hf.fast.compiled import _COMPILED, _COPIES
    from raincheck_hf.fast.context import STEP, StepScope

    graphs = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    g = torch.Generator().manual_seed(3)
    calls = {(4, 2): [(1, 256, 600), (5, 512, 600), (1, 512, 1200), (32, 256, 1200)],
             (8, 2): [(3, 256, 600), (17, 300, 600), (2, 512, 600)],
             (4, 4): [(1, 256, 600), (7, 300, 600), (1, 512, 600), (2, 256, 600)]}
    for (heads, kv_heads), shapes in calls.items():
        made = _COPIES.get(attention._few_query_rows, {}).get((heads, kv_heads, 16))
        before = 0 if made is None else len(graphs(made.__code__))  # (another test's steps on such heads: their graph)
        for rows, slots, capacity in shapes:
            q = torch.randn(1, rows, heads, 16, generator=g).transpose(1, 2)  # as the attention modules make it
            k = torch.randn(1, kv_heads, capacity, 16, generator=g)[:, :, :slots]
            v = torch.randn(1, kv_heads, capacity, 16, generator=g)[:, :, :slots]
            mask = torch.rand(rows, slots, generator=g) < 0.6
            mask[:, 0] = True
            module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
            with STEP.using(StepScope(frozenset(), {}, compiled=True, compiled_attention=True)), torch.no_grad():
                got, _ = attention.few_query_attention(module, q, k, v, mask[None, None], scaling=0.3)
            want = attention._few_query(q, k, v, mask[None, None], 0.3)
            assert got.shape == (1, rows, heads, 16) and (got - want).abs().max().item() <= 1e-5
        copy = _COPIES[attention._few_query_rows][(heads, kv_heads, 16)]
        assert _COMPILED[copy].error is None, _COMPILED[copy].error  # (compiled, not fallen back to the eager form)
        assert len(graphs(copy.__code__)) - before <= (2 if any(r == 1 for r, _, _ in shapes) else 1), (heads, kv_heads)
        assert len(graphs(copy.__code__)) >= 1
