"""The server's incremental detokenization (`serve.detok.IncrementalDetokenizer`, used by `serve.app`'s ``_Pieces``
and ``_StopStrings``) against the whole-answer rule it replaces (decode every token's whole answer), kept here as
the reference: random token sequences (fixed seeds) with the bundled glyph model's word-level tokenizer, the tiny
models' byte-level BPE, a byte-level BPE trained here on emoji, CJK and accents (characters split over tokens), a
SentencePiece-like one (its first token's leading space dropped) and tokenizers that must fall back to whole
decodes."""

from __future__ import annotations

import random

import pytest
import torch

from raincheck_hf.serve.app import _Pieces, _StopStrings
from raincheck_hf.serve.detok import REPLACEMENT, IncrementalDetokenizer, decodes_incrementally

SEEDS = range(24)

_CORPUS = [
    "Héllo wörld! Ça va? Über naïve café, déjà vu — señor.",
    "日本語のテキストと中文字符，还有한국어 문장도 있어요。",
    "Emoji: 😀 😃 👍🏽 🎉 🧪🚀 ❤️ 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "Mixed: the cat 🐈 sat on 桌子 at 3:45 p.m., (really!) [sure] {ok} \"quoted\" 'single'",
    "  spaces   and\ttabs\nnew lines\n\n  indented   text  ",
    "Math: ∑ x² ≤ ∞ ± √2 ≈ 1.414; arrows → ← ↑ ↓; € £ ¥ ₿",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<unk>"]


# ---- the reference: the whole-answer rule the server had ------------------------------------------------------
def whole_pieces(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    """The text the old ``_Pieces`` had handed out after each token, and after its end."""
    sent, out, handed = 0, "", []
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > sent:
            out, sent = out + text[sent:], len(text)
        handed.append(out)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return handed, out + text[sent:] if len(text) > sent else out


def whole_stop(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """The number of tokens at which the old ``_StopStrings`` stopped (None: never)."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if any(s in text for s in stop):
            return k
    return None


# ---- tokenizers -----------------------------------------------------------------------------------------------
def _fast(tok, **kwargs):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", extra_special_tokens={}, **kwargs)


def byte_level_bpe():
    """Byte-level BPE with a small vocabulary: emoji and CJK characters come in several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 3, trainer)
    tok.add_tokens(["<think>"])  # an added token that is not special: decoded, not skipped
    return _fast(tok)


def sentencepiece_like(decoder: str):
    """Metaspace BPE: the first token's leading space is dropped, by Llama's Strip decoder (``"strip"``) or by
    Metaspace's own ``prepend_scheme='first'`` (``"metaspace"``); ``"byte_fallback"``: Llama's decoders with byte
    fallback (characters outside the vocabulary as ``<0xNN>`` tokens, decoded a run at a time)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=decoder == "byte_fallback", unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if decoder == "metaspace":
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " ")]
                                        + [decoders.ByteFallback()] * (decoder == "byte_fallback")
                                        + [decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(_CORPUS * 3, trainer)
    if decoder == "byte_fallback":
        tok.add_tokens([f"<0x{b:02X}>" for b in range(256)])
    return _fast(tok)


def word_piece_cleaned():
    """WordPiece with transformers' ``clean_up_tokenization_spaces`` (a rewrite of the whole text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(_CORPUS * 3 + ["don't , it's . you're ! ok ? 'quoted'"] * 3, trainer)
    return _fast(tok, clean_up_tokenization_spaces=True)


class Numbered:
    """A fast tokenizer whose decode is not a window's: it prefixes the text with its token count (the
    detokenizer must see its window text change and decode whole from then on)."""

    is_fast, clean_up_tokenization_spaces = True, False

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __len__(self):
        return len(self.inner)

    @property
    def all_special_ids(self):
        return self.inner.all_special_ids

    def encode(self, text, **kwargs):
        return self.inner.encode(text, **kwargs)

    def decode(self, ids, skip_special_tokens=False):
        text = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return f"[{len(ids) // 8}]{text}" if text else text


def glyph_tokenizer():
    from raincheck_hf.quality.bundled import bundled_path, load_word_tokenizer

    return load_word_tokenizer(bundled_path("qwen3_vl"))


def tiny_tokenizer():
    from families import family_processor

    return family_processor("qwen3_vl").tokenizer


TOKENIZERS = {
    "glyph": glyph_tokenizer,
    "tiny": tiny_tokenizer,
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_strip": lambda: sentencepiece_like("strip"),
    "sentencepiece_metaspace": lambda: sentencepiece_like("metaspace"),
    "byte_fallback": lambda: sentencepiece_like("byte_fallback"),
    "word_piece_cleaned": word_piece_cleaned,
    "numbered": lambda: Numbered(byte_level_bpe()),
}
# decoded a window at a time; the others' whole decode can change text already handed out, so the streamed text is
# the whole-answer rule's (the reference), not always the whole decode
INCREMENTAL = {"glyph", "tiny", "byte_level_bpe", "sentencepiece_strip", "sentencepiece_metaspace"}

_built: dict = {}


def tokenizer_named(name: str):
    if name not in _built:
        _built[name] = TOKENIZERS[name]()
    return _built[name]


def random_answer(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Token ids as a model might give them and worse: pieces of encoded text (whole, or with tokens dropped:
    characters cut), special tokens, uniformly random ids (lone bytes of byte-level vocabularies), and runs of the
    first token of a non-ASCII character (in a byte-level vocabulary often a lead byte: a character never completed)."""
    specials = sorted(set(tokenizer.all_special_ids) | {tokenizer.encode(s, add_special_tokens=False)[0]
                                                         for s in SPECIALS[:4]})
    glyph_words = ["the", "red", "g3", "is", "blue", "left", "of", "?", "yes", "no"]
    pool = _CORPUS + [" ".join(glyph_words)]
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.45:
            text = rng.choice(pool)
            a = rng.randrange(len(text))
            piece = tokenizer.encode(text[a:a + rng.randint(1, 30)], add_special_tokens=False)
            if rng.random() < 0.3 and len(piece) > 1:  # a token or two dropped
                del piece[rng.randrange(len(piece))]
            ids += piece
        elif kind < 0.6:
            ids.append(rng.choice(specials))
        elif kind < 0.9:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
        else:
            lead = tokenizer.encode(rng.choice("😀日ü€🚀한"), add_special_tokens=False)[0]
            ids += [lead] * rng.randint(2, 24)
    return ids[:length]


def stop_strings(tokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """A few stop strings, mostly pieces of the answer's text (some found early, some late, some spanning tokens)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stop = [rng.choice(["zzz-never", "\n\n\n\n\n", "日本語のテキスト"])]
    for _ in range(rng.randint(1, 3)):
        if text:
            a = rng.randrange(len(text))
            stop.append(text[a:a + rng.randint(1, 8)])
    return stop


# ---- the tests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_text_matches_the_whole_decode_at_every_token(name):
    """Fed one token at a time, the text handed out after each token is what the whole-answer rule had handed out,
    which is the answer's whole decode wherever that does not end in U+FFFD; its text (the held-back end included)
    is the whole decode at every token; after the end, the whole decode."""
    tokenizer = tokenizer_named(name)
    assert decodes_incrementally(tokenizer) == (name in INCREMENTAL or name == "numbered")
    fell_back = held = moved = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = random_answer(tokenizer, rng, rng.randint(1, 90))
        expected, expected_final = whole_pieces(tokenizer, ids)
        detok, out = IncrementalDetokenizer(tokenizer), ""
        for k, token in enumerate(ids, 1):
            out += detok.add([token])
            assert out == expected[k - 1], (seed, k)
            full = tokenizer.decode(ids[:k], skip_special_tokens=True)
            if name in INCREMENTAL:
                if not full.endswith(REPLACEMENT):
                    assert out == full, (seed, k)
                assert detok.text == full, (seed, k)
            held += full.endswith(REPLACEMENT)
            moved += detok._start > 0
        fell_back += not detok.incremental
        out += detok.finish()
        assert out == expected_final, seed
        if name in INCREMENTAL:
            assert out == tokenizer.decode(ids, skip_special_tokens=True), seed
    if name in INCREMENTAL:
        assert fell_back == 0
    if name in INCREMENTAL:
        assert moved > 0  # the window's start moved up in some answers
    if name in ("tiny", "byte_level_bpe"):
        assert held > 0  # some answers ended inside a character for a while


def test_incremental_flag_and_fallback():
    """A tokenizer whose window text changes its start decodes whole from that token on (still exactly the
    whole-answer rule's text); a cleaned-up one decodes whole from the start; the others stay incremental."""
    rng = random.Random(0)
    numbered = tokenizer_named("numbered")
    ids = random_answer(numbered.inner, rng, 60)
    detok = IncrementalDetokenizer(numbered)
    assert detok.incremental
    for token in ids:
        detok.add([token])
    assert not detok.incremental
    for name in INCREMENTAL:
        detok = IncrementalDetokenizer(tokenizer_named(name))
        for token in random_answer(tokenizer_named(name), rng, 60):
            detok.add([token])
        assert detok.incremental, name
    assert not IncrementalDetokenizer(tokenizer_named("word_piece_cleaned")).incremental
    assert not IncrementalDetokenizer(tokenizer_named("byte_fallback")).incremental
    with pytest.raises(ValueError, match="lookback"):
        IncrementalDetokenizer(numbered, lookback=-1)


def test_several_tokens_at_once():
    """Tokens fed several at a time: after each call the text handed out is the whole decode (or, where that ends
    in U+FFFD, a start of it)."""
    tokenizer = tokenizer_named("byte_level_bpe")
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = random_answer(tokenizer, rng, 70)
        detok, out, k = IncrementalDetokenizer(tokenizer), "", 0
        while k < len(ids):
            step = rng.randint(1, 5)
            out += detok.add(ids[k:k + step])
            k += step
            full = tokenizer.decode(ids[:k], skip_special_tokens=True)
            assert out == full if not full.endswith(REPLACEMENT) else full.startswith(out), (seed, k)
        assert out + detok.finish() == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_pieces_stream_what_the_whole_rule_streamed(name):
    """``_Pieces`` fed as generate feeds a streamer (the prompt, then each token as a tensor): what it emitted after
    each token, and after ``end``, is what the whole-answer rule had emitted; it counts the tokens."""
    tokenizer = tokenizer_named(name)
    for seed in SEEDS[:8]:
        rng = random.Random(seed)
        ids = random_answer(tokenizer, rng, rng.randint(1, 80))
        expected, expected_final = whole_pieces(tokenizer, ids)
        emitted, counted = [], []
        pieces = _Pieces(tokenizer, emitted.append, counted.append)
        pieces.put(torch.tensor([[5, 6, 7]]))  # the prompt: not part of the answer
        for k, token in enumerate(ids, 1):
            pieces.put(torch.tensor([token]))
            assert all(kind == "text" and piece for kind, piece in emitted)
            assert "".join(piece for _, piece in emitted) == expected[k - 1], (seed, k)
        pieces.end()
        assert "".join(piece for _, piece in emitted) == expected_final
        assert sum(counted) == len(ids)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_stop_strings_stop_at_the_same_token(name):
    """``_StopStrings`` stops at the token where the whole-answer rule found a stop string in the decoded answer:
    through ``raincheck_host_stop`` on the batching loop's growing answer list, and through ``__call__`` on
    generate's ``input_ids`` (the prompt first)."""
    tokenizer = tokenizer_named(name)
    stopped_early = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        ids = random_answer(tokenizer, rng, rng.randint(1, 90))
        stop = stop_strings(tokenizer, ids, rng)
        expected = whole_stop(tokenizer, ids, stop)
        stopped_early += expected is not None and expected < len(ids)

        host, answer, got = _StopStrings(tokenizer, 3, stop), [], None
        for k, token in enumerate(ids, 1):
            answer.append(token)  # the loop's list: the same object, one token longer each call
            if host.raincheck_host_stop(answer):
                got = k
                break
        assert got == expected, (seed, stop)

        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 6))]
        called, got = _StopStrings(tokenizer, len(prompt), stop), None
        for k in range(1, len(ids) + 1):
            if called(torch.tensor([prompt + ids[:k]]), None)[0]:
                got = k
                break
        assert got == expected, (seed, stop)
    assert stopped_early > len(SEEDS) // 3  # the stop strings were found mid-answer in many answers


def test_stop_strings_edge_cases():
    """An empty stop string stops at the first token (as ``"" in text``); no stop strings never stop; an answer
    that does not extend the last call's is checked whole; once stopped it stays stopped."""
    tokenizer = tokenizer_named("byte_level_bpe")
    ids = tokenizer.encode("Héllo wörld! 日本語 😀 done", add_special_tokens=False)
    assert _StopStrings(tokenizer, 0, [""]).raincheck_host_stop(ids[:1])
    never = _StopStrings(tokenizer, 0, [])
    assert not any(never.raincheck_host_stop(ids[:k]) for k in range(1, len(ids) + 1))
    stop = _StopStrings(tokenizer, 0, ["wörld"])
    assert not stop.raincheck_host_stop(tokenizer.encode("Héllo", add_special_tokens=False))
    assert stop.raincheck_host_stop(ids)  # not the last answer plus tokens: the whole text is searched
    assert stop.raincheck_host_stop(ids[:1])
    restarted = _StopStrings(tokenizer, 0, ["日本"])
    assert not restarted.raincheck_host_stop(ids[:3])
    assert not restarted.raincheck_host_stop(ids[:2] + [ids[0]])  # same length, another last token: checked again
    assert restarted.raincheck_host_stop(ids)


def test_a_character_that_never_completes():
    """A long run of lone lead bytes (each a U+FFFD once the next comes, the last one held back) keeps the text
    held back and the window growing; the next ASCII token releases all of it, and the window moves up again."""
    tokenizer = tokenizer_named("byte_level_bpe")
    lead, a = tokenizer.convert_tokens_to_ids("ð"), tokenizer.convert_tokens_to_ids("a")  # byte 0xF0, "a"
    ids = tokenizer.encode("Héllo 日本", add_special_tokens=False) + [lead] * 40 + [a] * 30
    detok, out, outs, window = IncrementalDetokenizer(tokenizer), "", [], []
    for k, token in enumerate(ids, 1):
        out += detok.add([token])
        full = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert detok.text == full and (out == full if not full.endswith(REPLACEMENT) else full.startswith(out))
        outs.append(out)
        window.append(k - detok._start)
    first_a = ids.index(a)
    assert outs[first_a - 1] == "Héllo 日本" and outs[first_a] == "Héllo 日本" + "\ufffd" * 40 + "a"
    assert window[first_a - 1] > 40 and window[-1] <= IncrementalDetokenizer.WINDOW + 1
    assert out == "Héllo 日本" + "\ufffd" * 40 + "a" * 30


def test_lookback_covers_a_match_across_pieces():
    """``recent`` holds ``lookback`` characters of the text before the new text: a match that started tokens ago is
    found when its last token comes, and not before."""
    tokenizer = tokenizer_named("glyph")
    words = "the red g3 is blue of the blue g3".split()
    ids = [tokenizer.convert_tokens_to_ids(w) for w in words]
    assert tokenizer.unk_token_id not in ids
    detok = IncrementalDetokenizer(tokenizer, lookback=len("is blue of the blue") - 1)
    found = [k for k, token in enumerate(ids, 1) if (detok.add([token]), "is blue of the blue" in detok.recent)[1]]
    assert found == [8]
