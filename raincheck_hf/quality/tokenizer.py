"""A word-level tokenizer with Qwen's special tokens, and a real `Qwen3VLProcessor` around it.

The glyph benchmark's language is a few dozen words; a word-level vocabulary keeps the bundled
models' embeddings tiny and makes every answer word one token (so a fact is one sampled token).
Words outside the vocabulary map to ``<unk>``. The same processor serves the Qwen3.5 model:
transformers uses `Qwen3VLProcessor` for qwen3_5 as well.
"""

from __future__ import annotations

from ..tiny import CHAT_TEMPLATE, SPECIAL_TOKENS
from .glyphs import CELL_PIXELS, vocabulary

UNK = "<unk>"
ROLE_WORDS = ["system", "user", "assistant"]
# the largest image the processor keeps at native size: 14×14 merged tokens (a user's own images
# are resized down to this; glyph grids are at most 10×10)
MAX_CELLS_PER_SIDE = 14


def word_vocabulary() -> list[str]:
    """Special tokens first (ids 0…6 as in the tiny tokenizer), then ``<unk>``, roles and the benchmark's words."""
    words = [UNK] + ROLE_WORDS + [w for w in vocabulary() if w not in ROLE_WORDS]
    return SPECIAL_TOKENS + list(dict.fromkeys(words))


def build_word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(word_vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # words and punctuation runs; whitespace (the template's newlines too) carries no token
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={},
        chat_template=CHAT_TEMPLATE,
    )


def build_glyph_processor():
    """`Qwen3VLProcessor` (16 px patches, 2×2 merge) that keeps a glyph grid at its native size."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    side = MAX_CELLS_PER_SIDE * CELL_PIXELS
    common = dict(patch_size=16, merge_size=2, temporal_patch_size=2,
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 2 * 2 * CELL_PIXELS ** 2,
                                                  "longest_edge": side * side}, **common)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": 2 * 2 * CELL_PIXELS ** 2,
                                                  "longest_edge": side * side * 4},
                                            do_sample_frames=False, cap_pixels_per_frame=True, **common)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=build_word_tokenizer(),
                            video_processor=video_processor, chat_template=CHAT_TEMPLATE)
