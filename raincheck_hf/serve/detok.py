"""The answer's text as its tokens come, decoding only a short window of recent tokens per token.

The server streams an answer's new text after every token (`app._Pieces`) and looks for its stop strings in it
(`app._StopStrings`). Decoding the whole answer after every token costs O(n) per token, O(n²) per answer, and in
batching mode it runs on the loop's thread between two steps, for every running answer, while the device waits.

`IncrementalDetokenizer` decodes ``ids[start:]`` instead, where ``start`` is a token that begins a character and
sits a few tokens back, and takes the new text as what that window's text adds to its text at the last settled
point (the window's first tokens are context: a decoder that treats the first token apart, SentencePiece's dropped
leading space, does so in both decodes alike). Text that ends in U+FFFD (the bytes decoded so far end inside a
multi-byte character, a byte-level BPE splitting an emoji or a CJK character over tokens) is held back until a
token completes it, as the whole-answer rule did; while it stays incomplete (or the new tokens are skipped special
tokens) the window grows, costing at most the whole decode per token. The text handed out is exactly
``tokenizer.decode(ids, skip_special_tokens=True)`` at every token where that does not end in U+FFFD, and at the
end.

Exactness needs a decoder whose text for a token depends only on its near neighbours, which most fast tokenizers'
decoders have (byte-level, Metaspace, WordPiece, strip). transformers' ``clean_up_tokenization_spaces`` rewrites the
whole text (``" ."`` becomes ``"."``: a space already handed out disappears), a byte-fallback decoder decodes runs of
byte tokens together (`decodes_incrementally`) and slow tokenizers are Python code of each model's own: for those,
and for any tokenizer whose window text stops extending its earlier text (checked at every token), it decodes the
whole answer per token, as before.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("raincheck_hf.serve")

REPLACEMENT = "\ufffd"  # what a decode gives for bytes that end inside a character


def decodes_incrementally(tokenizer) -> bool:
    """Whether ``tokenizer``'s decode can be taken a window at a time: a fast (Rust `tokenizers`) tokenizer without
    transformers' ``clean_up_tokenization_spaces`` (a rewrite of the whole text) and without a byte-fallback decoder
    (SentencePiece's ``<0xNN>`` tokens: a run of them is decoded together and, when it is not UTF-8, every byte of it
    becomes U+FFFD, so a byte's text already handed out, a newline, can change when an invalid byte follows)."""
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteFallback" not in repr(decoder)


class IncrementalDetokenizer:
    """One answer's text, fed its token ids as they come (`add`), then ended (`finish`).

    `add` and `finish` return the text to hand out, as the whole-answer rule did it: after every token, the text
    beyond what was handed out so far unless the answer's text ends in U+FFFD; at the end, the rest. ``recent`` is
    the part of the answer's text that the last `add` may have changed (its new text, the held-back text included),
    after up to ``lookback`` characters of the text before it: a string of length up to ``lookback + 1`` found in
    the answer's text by this token lies in it (`app._StopStrings`). When the whole answer is decoded instead
    (``incremental`` False), ``recent`` is the whole text.

    Attributes:
        ids: the answer's token ids so far.
        incremental: whether it decodes a window per token (see the module's docstring); False from the first token
            whose window text does not extend the window's earlier text.
    """

    WINDOW = 8  # tokens in the decoded window before its start moves up (one more decode when it does)

    def __init__(self, tokenizer, lookback: int = 0):
        if lookback < 0:
            raise ValueError(f"lookback must be >= 0 (characters before the new text), got {lookback}")
        self.tokenizer, self.lookback = tokenizer, lookback
        self.ids: list[int] = []
        self.incremental = decodes_incrementally(tokenizer)
        self.recent = ""
        self._sent = 0  # characters handed out
        self._parts: list[str] = []  # the settled text (incremental), piece by piece
        self._tail = ""  # its last ``lookback`` characters
        self._start = self._settled = 0  # the window's first token; the tokens up to the last settled point
        self._window_text = ""  # decode(ids[_start:_settled])
        self._pending = ""  # the text of ids[_settled:], held back: it ends in U+FFFD
        self._grew = (0, 0)  # the last two settled points where the text grew: a new window start comes from these
        self._whole = ""  # without ``incremental``: the whole text at the last token

    @property
    def text(self) -> str:
        """The answer's text so far (the held-back end included)."""
        return "".join(self._parts) + self._pending if self.incremental else self._whole

    def add(self, ids: list[int]) -> str:
        """Feed the next token ids (usually one); the text to hand out now (possibly empty)."""
        self.ids.extend(ids)
        if self.incremental:
            piece = self._add_window()
            if piece is not None:
                return piece
        return self._add_whole()

    def finish(self) -> str:
        """The text not handed out yet (a held-back end included), at the answer's end."""
        if self.incremental:  # a later `add` (none is expected) decodes whole, handing out beyond this text
            self._whole, self.incremental = self.text, False
        if len(self._whole) <= self._sent:
            return ""
        piece, self._sent = self._whole[self._sent:], len(self._whole)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _add_window(self) -> str | None:
        """`add` by a window: the text to hand out, or None when the window's text does not extend its text at the
        last settled point (then it decodes whole from now on)."""
        n = len(self.ids)
        text = self._decode(self.ids[self._start:])
        if not text.startswith(self._window_text):
            logger.debug("%s does not decode incrementally (a window's text changed its start): whole decodes for "
                         "the rest of the answer", type(self.tokenizer).__name__)
            self.incremental = False
            return None
        new = text[len(self._window_text):]
        self.recent = self._tail + new
        if text.endswith(REPLACEMENT):  # inside a character (or a real U+FFFD): the next token may change it
            self._pending = new
            return ""
        self._pending = ""
        self._settled, self._window_text = n, text
        if new:
            self._parts.append(new)
            self._sent += len(new)
            self._grew = (self._grew[1], n)
            if self.lookback:
                self._tail = self.recent[-self.lookback:]
        # the window moves up to the earlier of the last two points where the text grew: its first tokens then give
        # text (were they all skipped special tokens, a decoder that treats the first token apart would treat the
        # next one so, a space lost)
        if n - self._start > self.WINDOW and self._grew[0] > self._start:
            self._start = self._grew[0]
            self._window_text = self._decode(self.ids[self._start:n])
        return new

    def _add_whole(self) -> str:
        self._whole = self.recent = self._decode(self.ids)
        if self._whole.endswith(REPLACEMENT) or len(self._whole) <= self._sent:
            return ""
        piece, self._sent = self._whole[self._sent:], len(self._whole)
        return piece
