"""`fast.vision_attention`: the vision tower's rotary embedding in one Triton kernel computes what transformers'
``apply_rotary_pos_emb_vision`` computes, bit for bit (Triton's interpreter on CPU, ``TRITON_INTERPRET=1``, in a
subprocess: the variable is read when Triton compiles a kernel); the fast path's tower forwards use it on every family
and give the stock features exactly; the patch acts only inside the scope and only for its thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from raincheck_hf._triton import triton_available
from raincheck_hf.fast import vision_attention
from raincheck_hf.fast.vision_graphs import VisionGraphs
from raincheck_hf.models import get_adapter

from conftest import INPUT_CASES, make_inputs
from families import family_model, family_params, family_processor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from raincheck_hf.fast import vision_attention
from raincheck_hf.fast.vision_graphs import VisionGraphs
from raincheck_hf.models import get_adapter
from transformers.models.qwen3_vl import modeling_qwen3_vl
from conftest import INPUT_CASES, make_inputs
from families import family_model, family_processor

results = {"rotary": [], "towers": []}
module = modeling_qwen3_vl.Qwen3VLVisionAttention  # (its modeling file's rotation is the reference)
for seed, (S, H, D, dtype, cos_dtype, strided) in enumerate(json.loads(sys.argv[1])):
    g = torch.Generator().manual_seed(seed)
    dtype, cos_dtype = getattr(torch, dtype), getattr(torch, cos_dtype)
    qkv = (torch.randn(S, 3, H, D, generator=g) * 3).to(dtype)
    angles = torch.randn(S, D // 2, generator=g) * 20
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)
    if strided:  # rows of the tables and of the projection further apart than their widths
        cos = torch.cat([cos, torch.zeros_like(cos)], -1)[:, :D]
        sin = torch.cat([sin, torch.zeros_like(sin)], -1)[:, :D]
        qkv = torch.cat([qkv.reshape(S, -1), torch.zeros(S, 5, dtype=dtype)], -1)[:, :3 * H * D].view(S, 3, H, D)
    assert vision_attention.kernel_usable(qkv, cos, sin)
    want = vision_attention.rotary_qkv_reference(module.__new__(module), qkv, cos, sin)
    got = vision_attention.rotary_qkv(qkv, cos, sin)
    results["rotary"].append({"size": [S, H, D], "dtype": str(dtype), "strided": strided,
                              "equal": [bool(torch.equal(a, b)) for a, b in zip(got, want)],
                              "contiguous": [bool(t.is_contiguous()) for t in got],
                              "dtypes": [str(t.dtype) for t in got]})

calls = [0]
kernel = vision_attention.rotary_qkv
def counted(*args):
    calls[0] += 1
    return kernel(*args)
vision_attention.rotary_qkv = counted
for family in sys.argv[2].split(","):
    model, processor = family_model(family), family_processor(family)
    adapter = get_adapter(model)
    for case in ("two_images", "video"):
        inputs = make_inputs(processor, **INPUT_CASES[case])
        values, grid = (("pixel_values", "image_grid_thw") if "image_grid_thw" in inputs
                        else ("pixel_values_videos", "video_grid_thw"))
        encode = model.model.get_image_features if values == "pixel_values" else model.model.get_video_features
        before = calls[0]
        with torch.no_grad():
            ours = VisionGraphs(adapter, use_graphs=False).encode(inputs[values], inputs[grid])
            used = calls[0] - before
            stock = encode(inputs[values], inputs[grid], return_dict=True)
        equal = all(torch.equal(a, b) for a, b in zip(stock.pooler_output, ours.pooler_output))
        for layer_a, layer_b in zip(getattr(stock, "deepstack_features", None) or [], ours.deepstack_features or []):
            equal = equal and all(torch.equal(a, b) for a, b in zip(layer_a, layer_b))
        results["towers"].append({"family": family, "case": case, "equal": equal, "kernel_calls": used,
                                  "blocks": len(adapter.vision_tower.blocks),
                                  "stock_calls_after": calls[0] - before - used})
print(json.dumps(results))
"""

# (rows, heads, head size, dtype, the tables' dtype, strided rows): one row, rows across the 32-row blocks, a head
# size whose half is no power of two (Qwen3-VL's 72), half precision, tables in another dtype than the projection
SIZES = [(1, 2, 8, "float32", "float32", False), (37, 3, 12, "float32", "float32", False),
         (70, 2, 72, "bfloat16", "float32", False), (33, 4, 16, "float16", "float32", True),
         (65, 1, 40, "bfloat16", "bfloat16", True)]


@pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs the kernel on CPU)")
def test_rotary_kernel_and_fused_tower_match_stock_in_interpreter():
    families = [p.values[0] for p in family_params()]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(SIZES), ",".join(families)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results["rotary"]) == len(SIZES)
    for r in results["rotary"]:
        assert r["equal"] == [True, True], r
        assert r["contiguous"] == [True, True] and len(set(r["dtypes"])) == 1, r
    assert len(results["towers"]) == 2 * len(families)
    for r in results["towers"]:
        # every block of the tower went through the kernel (the video: once per block as well, its frames' windows
        # split after the rotation), the stock call after the scope not at all, and the features are stock's
        assert r["equal"] and r["kernel_calls"] == r["blocks"] and r["stock_calls_after"] == 0, r


def test_without_the_kernel_the_fused_forward_is_the_stock_forward(monkeypatch):
    """On CPU without the interpreter the kernel is not usable: the scope changes nothing (same features) and the
    patch is gone after it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, processor = family_model("qwen3_vl"), family_processor("qwen3_vl")
    adapter = get_adapter(model)
    inputs = make_inputs(processor, **INPUT_CASES["one_image"])
    with torch.no_grad():
        stock = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        ours = VisionGraphs(adapter, use_graphs=False).encode(inputs["pixel_values"], inputs["image_grid_thw"])
    assert all(torch.equal(a, b) for a, b in zip(stock.pooler_output, ours.pooler_output))
    assert all("forward" not in vars(m) for m in vision_attention.attention_modules(adapter.vision_tower))


def test_the_patch_acts_only_inside_the_scope_and_only_for_its_thread(monkeypatch):
    model = family_model("qwen3_vl")
    tower = get_adapter(model).vision_tower
    modules = vision_attention.attention_modules(tower)
    assert modules and len(modules) == len(tower.blocks)
    seen = []
    monkeypatch.setattr(vision_attention, "fused_forward", lambda module, *a, **k: seen.append(module) or "fused")
    hidden, cu = torch.zeros(4, tower.config.hidden_size), torch.tensor([0, 4])
    head = tower.config.hidden_size // modules[0].num_heads
    rotary = (torch.ones(4, head), torch.zeros(4, head))
    stock_seen = {}

    def other_thread():
        with torch.no_grad():
            stock_seen["out"] = modules[0](hidden, cu, position_embeddings=rotary)

    with vision_attention.vision_attention_scope(tower):
        assert all("forward" in vars(m) for m in modules)
        assert modules[0](hidden, cu, position_embeddings=rotary) == "fused"
        thread = threading.Thread(target=other_thread)  # (a thread started inside the scope runs stock)
        thread.start()
        thread.join()
        with vision_attention.vision_attention_scope(tower):  # nested: counted, still patched after the inner exit
            pass
        assert all("forward" in vars(m) for m in modules)
    assert seen == [modules[0]]
    assert torch.is_tensor(stock_seen["out"]) and stock_seen["out"].shape == hidden.shape
    assert all("forward" not in vars(m) for m in modules)
    with vision_attention.vision_attention_scope(tower, enabled=False):
        assert all("forward" not in vars(m) for m in modules)


def test_the_benchmarks_switch_of_the_kernel_is_scoped_to_its_block_and_thread():
    """`one_kernel_rotation(False)` (the rotary benchmark's stock form): inside the block, this thread's scopes patch
    nothing and the tower graphs' key says so (one graph per form); another thread, and this one after the block,
    keep the default; a value other than a bool is refused."""
    model = family_model("qwen3_vl")
    tower = get_adapter(model).vision_tower
    modules = vision_attention.attention_modules(tower)
    graphs = VisionGraphs(get_adapter(model), use_graphs=False)
    pixels = torch.zeros(16, 8)
    seen = {}

    def other_thread():
        seen["other"] = vision_attention.rotation_kernel_enabled()

    with vision_attention.one_kernel_rotation(False):
        assert not vision_attention.rotation_kernel_enabled()
        off = graphs._key(tower, pixels, (1, 4, 4))
        with vision_attention.vision_attention_scope(tower):
            assert all("forward" not in vars(m) for m in modules)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["other"] is True and vision_attention.rotation_kernel_enabled()
    on = graphs._key(tower, pixels, (1, 4, 4))
    assert on[:-1] == off[:-1] and on[-1] is True and off[-1] is False
    with vision_attention.vision_attention_scope(tower):
        assert all("forward" in vars(m) for m in modules)
    with pytest.raises(ValueError, match="one_kernel_rotation: enabled=1"):
        with vision_attention.one_kernel_rotation(1):
            pass


def test_kernel_usable_refuses_what_it_does_not_take(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not triton_available():
        pytest.skip("needs Triton")
    qkv, cos = torch.zeros(5, 3, 2, 8), torch.zeros(5, 8)
    assert vision_attention.kernel_usable(qkv, cos, cos)
    assert not vision_attention.kernel_usable(torch.zeros(5, 3, 2, 7), torch.zeros(5, 7), torch.zeros(5, 7))  # odd
    assert not vision_attention.kernel_usable(qkv, torch.zeros(5, 4), cos)  # a table of another width
    assert not vision_attention.kernel_usable(qkv.double(), cos, cos)
    assert not vision_attention.kernel_usable(qkv.transpose(2, 3), cos, cos)  # the head's values not contiguous
    grad = qkv.clone().requires_grad_()
    assert not vision_attention.kernel_usable(grad, cos, cos)
    with torch.no_grad():
        assert vision_attention.kernel_usable(grad, cos, cos)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not vision_attention.kernel_usable(qkv, cos, cos)  # CPU tensors without the interpreter
