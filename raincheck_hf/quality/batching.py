"""Training batches of glyph dialogues, built without the processor's per-image Python work.

`glyph_batch` draws the grids on the target device (`glyphs.render_grids`), normalises and
patchifies them the way `Qwen2VLImageProcessor` does, and tokenises the chat text with the image
placeholders already expanded. `processor_batch` is the slow reference: the real processor on the
real PIL images. `tests/test_quality.py` checks they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .glyphs import Dialogue, render_grids

PATCH, MERGE, TEMPORAL = 16, 2, 2


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L], right-padded
    attention_mask: torch.Tensor  # [B, L]
    mm_token_type_ids: torch.Tensor  # [B, L], 1 on image placeholders
    pixel_values: torch.Tensor  # [sum of patches, 3 * 2 * 16 * 16]
    image_grid_thw: torch.Tensor  # [B, 3]
    loss_mask: torch.Tensor  # [B, L] bool: the assistant's answer tokens and their <|im_end|>

    def model_inputs(self) -> dict:
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                    mm_token_type_ids=self.mm_token_type_ids, pixel_values=self.pixel_values,
                    image_grid_thw=self.image_grid_thw)


def patchify(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` normalised images → ``[B * H/16 * W/16, 1536]`` in the Qwen2-VL processor's order.

    Patches are grouped by 2×2 merge block (block row, block col, row in block, col in block); each
    patch flattens as (channel, temporal copy, y, x), the still image repeated over the 2 frames of
    a temporal patch.
    """
    b, c, h, w = images.shape
    gh, gw = h // PATCH, w // PATCH
    x = images.reshape(b, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [b, bh, bw, mh, mw, c, py, px]
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, TEMPORAL, -1, -1)
    return x.reshape(b * gh * gw, c * TEMPORAL * PATCH * PATCH)


def answer_mask(input_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """True on every token of an assistant message and its closing ``<|im_end|>`` (what the model is taught)."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assistant = tokenizer.convert_tokens_to_ids("assistant")
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, ids in enumerate(input_ids.tolist()):
        inside = False
        for j, tok in enumerate(ids):
            if inside:
                mask[row, j] = True
                inside = tok != end
            elif tok == assistant and j > 0 and ids[j - 1] == start:
                inside = True
    return mask


def _expanded_text(processor, d: Dialogue) -> str:
    text = processor.apply_chat_template(d.messages(), tokenize=False)
    return text.replace("<|image_pad|>", "<|image_pad|>" * (d.grid * d.grid), 1)


def encode_dialogues(dialogues: list[Dialogue], processor) -> dict:
    """The CPU half of a batch (token ids, masks, grid indices): cheap to run in a loader worker."""
    grids = {d.grid for d in dialogues}
    if len(grids) != 1:
        raise ValueError(f"a batch needs dialogues of one grid size, got {sorted(grids)}")
    tok = processor.tokenizer
    enc = tok([_expanded_text(processor, d) for d in dialogues], padding=True, return_tensors="pt",
              add_special_tokens=False)
    ids = enc["input_ids"]
    colour, glyph, background = (torch.cat(t) for t in zip(*(d.index_tensors() for d in dialogues)))
    return dict(input_ids=ids, attention_mask=enc["attention_mask"],
                mm_token_type_ids=(ids == tok.convert_tokens_to_ids("<|image_pad|>")).long(),
                loss_mask=answer_mask(ids, tok), colour=colour, glyph=glyph, background=background)


def batch_on_device(encoded: dict, device="cpu") -> Batch:
    """The device half: draw the grids where the model runs, normalise, patchify."""
    idx = [encoded[k].to(device, non_blocking=True) for k in ("colour", "glyph", "background")]
    n = idx[0].shape[-1]
    pixels = render_grids(*idx).float().div_(255.0).sub_(0.5).div_(0.5)
    return Batch(
        input_ids=encoded["input_ids"].to(device),
        attention_mask=encoded["attention_mask"].to(device),
        mm_token_type_ids=encoded["mm_token_type_ids"].to(device),
        pixel_values=patchify(pixels),
        image_grid_thw=torch.tensor([[1, 2 * n, 2 * n]] * idx[0].shape[0], device=device),
        loss_mask=encoded["loss_mask"].to(device),
    )


def glyph_batch(dialogues: list[Dialogue], processor, device="cpu") -> Batch:
    """Dialogues on one grid size → a `Batch` on ``device`` (the fast path)."""
    return batch_on_device(encode_dialogues(dialogues, processor), device)


def processor_batch(dialogues: list[Dialogue], processor) -> Batch:
    """The same batch through the real processor and PIL images (the reference for `glyph_batch`)."""
    texts = [processor.apply_chat_template(d.messages(), tokenize=False) for d in dialogues]
    enc = processor(text=texts, images=[d.image() for d in dialogues], padding=True, return_tensors="pt")
    return Batch(enc["input_ids"], enc["attention_mask"], enc["mm_token_type_ids"], enc["pixel_values"],
                 enc["image_grid_thw"], answer_mask(enc["input_ids"], processor.tokenizer))
