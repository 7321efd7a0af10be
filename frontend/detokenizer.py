"""Incremental detokenization: token ids in, newly completed text out, one request at a time.

The engine streams token ids; the frontend turns them into text deltas. Decoding the whole output
again at every step is O(n) per token, so each detokenizer decodes only a small window: the tokens
of the last emitted chunk (the "prefix", whose text is known) plus the tokens not yet emitted. The
new text is the window's text minus the prefix's text. Text is held back while it ends with U+FFFD,
because that means a multi-byte UTF-8 character (or a byte-fallback sequence) is still arriving.

Two implementations share one interface (:class:`IncrementalDetokenizer`):

* :class:`DecodeStreamDetokenizer` steps ``tokenizers.decoders.DecodeStream`` (the window logic in
  Rust) on the fast tokenizer's backend. Used whenever the tokenizer has one.
* :class:`TokenWindowDetokenizer` does the same over ``convert_ids_to_tokens`` and
  ``convert_tokens_to_string``, for Python ("slow") tokenizers, and when
  ``spaces_between_special_tokens`` is given explicitly (the fast decoder cannot honour it).

Use :func:`create_detokenizer` to get the right one, and :func:`decode_token` for the text of a
single token in logprob entries.
"""

from __future__ import annotations

import abc
import logging
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21 has no DecodeStream: every request takes the fallback
    BackendTokenizer = None  # type: ignore[assignment,misc]
    DecodeStream = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

__all__ = [
    "DecodeStreamDetokenizer",
    "IncrementalDetokenizer",
    "TokenWindowDetokenizer",
    "create_detokenizer",
    "decode_token",
]

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens seed the window. Decoders that look at the previous token (Metaspace and
# Strip drop the first token's leading space; WordPiece glues "##" pieces to the previous token)
# need one real token of context; a few more survive a prompt that ends in skipped special tokens.
PROMPT_CONTEXT_TOKENS = 6

# A UTF-8 character is at most 4 bytes and every byte-level or byte-fallback token carries at
# least one, so legitimate text never keeps more than 4 tokens pending. More means the model emits
# invalid UTF-8 (or text that really ends in U+FFFD); we then emit what we have rather than
# re-decode an ever-growing window (O(n^2)) and stream nothing.
MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer(abc.ABC):
    """Turns one sequence's output token ids into text deltas.

    Contract, for ``deltas = [d.update(ids_1), d.update(ids_2), ..., d.flush()]``:

    * no delta ends inside a multi-byte character: while a character's bytes are still arriving the
      text is held (a delta contains U+FFFD only where the full decode has one, or after
      ``MAX_PENDING_TOKENS`` tokens without a complete character);
    * ``"".join(deltas) == tokenizer.decode(all_ids, skip_special_tokens=skip_special_tokens,
      clean_up_tokenization_spaces=False)``. It holds exactly for context-free decoders
      (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM2; ByteFallback; ByT5), with or without a
      prompt, and for every decoder when ``prompt_token_ids`` is empty. It does not hold where:

      - a prompt is given and the decoder depends on the previous token: the first output token is
        decoded as a continuation of the prompt, so a Metaspace/Strip decoder keeps its leading
        space (``" Hello"`` where ``decode(output)`` gives ``"Hello"``) and a WordPiece ``"##ing"``
        joins the prompt's last word (``"ing"`` where ``decode(output)`` gives ``"##ing"``). This
        is on purpose: the stream is the text that follows the prompt;
      - the tokenizer's ``clean_up_tokenization_spaces`` is on: that rewrite (``" ."`` -> ``"."``)
        looks across token boundaries and is not applied to the stream;
      - ``spaces_between_special_tokens`` is given explicitly (see :func:`create_detokenizer`);
      - the prompt ends inside a multi-byte character: that character is split between prompt and
        output, and the output starts with the U+FFFD that ``decode(output)`` also has;
      - the decoder is not prefix-stable (later tokens change the text of earlier ones); the
        stream then cannot take back what it sent and logs a warning once.
    """

    __slots__ = ()

    @abc.abstractmethod
    def update(self, new_token_ids: Iterable[int]) -> str:
        """Adds the new output token ids; returns the text they complete ("" if none yet)."""

    @abc.abstractmethod
    def flush(self) -> str:
        """Returns the text still held at the end of the request (an incomplete character decodes
        to U+FFFD, as in the full decode). Call once, after the last :meth:`update`."""

    def decode_all(self, token_ids: list[int], flush: bool = True) -> str:
        """``update(token_ids) + flush()`` (without the flush: ``update(token_ids)``, the text
        of a request cut short, whose held bytes are dropped), for a consumer that needs the
        text only once the request is over (it then skips the per-token work of the stream).
        Call once, instead of any :meth:`update`."""
        text = self.update(token_ids)
        return text + self.flush() if flush else text


def create_detokenizer(
    tokenizer: Any,
    prompt_token_ids: Sequence[int] = (),
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool | None = None,
) -> IncrementalDetokenizer:
    """Returns the incremental detokenizer for one sequence of one request.

    ``tokenizer``: a transformers tokenizer (fast or Python) or a ``tokenizers.Tokenizer``.
    ``prompt_token_ids``: the request's prompt; its last few tokens are decoding context only (see
    :class:`IncrementalDetokenizer` for when that changes the text).
    ``spaces_between_special_tokens``: ``None`` (default) joins special/added tokens the way the
    tokenizer's own ``decode`` does. ``True``/``False`` decodes added tokens as separate pieces
    joined with/without a space (transformers 4 "slow" semantics); the fast decoder cannot do that,
    so it selects :class:`TokenWindowDetokenizer` (slower, and no longer equal to ``decode``).
    """
    backend = _backend_of(tokenizer)
    if backend is not None and DecodeStream is not None and spaces_between_special_tokens is None:
        return DecodeStreamDetokenizer.new(backend, prompt_token_ids, skip_special_tokens)
    if not hasattr(tokenizer, "convert_tokens_to_string"):
        raise TypeError(f"cannot detokenize with {type(tokenizer).__name__}: no fast backend "
                        "and no convert_tokens_to_string")
    return TokenWindowDetokenizer.new(tokenizer, prompt_token_ids, skip_special_tokens,
                                      spaces_between_special_tokens)


def _backend_of(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a tokenizer, or None for Python-only tokenizers."""
    if BackendTokenizer is None:
        return None
    if isinstance(tokenizer, BackendTokenizer):
        return tokenizer
    # transformers' Python tokenizers have no backend_tokenizer; some raise instead of lacking it
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
    except (AttributeError, NotImplementedError, ValueError):
        return None
    return backend if isinstance(backend, BackendTokenizer) else None


@dataclass(slots=True, eq=False)
class DecodeStreamDetokenizer(IncrementalDetokenizer):
    """:class:`IncrementalDetokenizer` over ``tokenizers.decoders.DecodeStream``.

    DecodeStream keeps the window itself; we mirror which ids form the last emitted chunk and
    which are pending, because DecodeStream alone cannot flush held bytes at the end, never gives
    up on a window that keeps ending in U+FFFD, and raises on a decoder that is not prefix-stable.
    """

    backend: Any
    skip_special_tokens: bool
    _stream: Any
    # ids of the last emitted chunk (or the prompt context before the first one): the window's
    # context, whose text the pending ids' text is measured against
    _prev_ids: list[int]
    _pending_ids: list[int] = field(default_factory=list)
    _warned: bool = False

    @classmethod
    def new(cls, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
            ) -> DecodeStreamDetokenizer:
        """``tokenizer``: a fast transformers tokenizer or its ``tokenizers.Tokenizer``."""
        backend = _backend_of(tokenizer)
        if backend is None or DecodeStream is None:
            raise TypeError(
                f"{type(tokenizer).__name__} has no tokenizers backend with DecodeStream")
        context = _trim_incomplete_tail(backend, _prompt_context(prompt_token_ids),
                                        skip_special_tokens)
        return cls(backend, skip_special_tokens, _new_stream(backend, context, skip_special_tokens),
                   context)

    def update(self, new_token_ids: Iterable[int]) -> str:
        pieces: list[str] = []
        stream = self._stream
        backend = self.backend
        pending = self._pending_ids
        for token_id in new_token_ids:
            # one step per id (not one step over the list) so that text completed before a
            # character still in flight at the end of the batch is not held back with it
            pending.append(token_id)
            try:
                text = stream.step(backend, token_id)
            except Exception as exc:  # tokenizers raises a plain Exception for InvalidPrefix
                self._warn_once("DecodeStream failed (%s); re-decoding the window", exc)
                pieces.append(self._resync())
                stream, pending = self._stream, self._pending_ids
                continue
            if text is not None:
                pieces.append(text)
                self._prev_ids = pending
                pending = self._pending_ids = []
            elif len(pending) > MAX_PENDING_TOKENS:
                self._warn_once("%d tokens without a complete character; emitting U+FFFD",
                                len(pending))
                pieces.append(self._resync())
                stream, pending = self._stream, self._pending_ids
        return pieces[0] if len(pieces) == 1 else "".join(pieces)

    def flush(self) -> str:
        if not self._pending_ids:
            return ""
        return self._resync()

    def decode_all(self, token_ids: list[int], flush: bool = True) -> str:
        # One decode of context + output (and one of the context) instead of a stream step per
        # token: the same text wherever it has no U+FFFD, as the stream emits each piece as
        # that decode's continuation of the piece before. Where it has one (invalid UTF-8, a
        # character still incomplete at the end, which the stream holds back or, after
        # MAX_PENDING_TOKENS, cuts into pieces of its own), the stream decides.
        if self._pending_ids:
            return IncrementalDetokenizer.decode_all(self, token_ids, flush)
        skip = self.skip_special_tokens
        context = self._prev_ids
        decode = self.backend.decode
        prev_text = decode(context, skip_special_tokens=skip) if context else ""
        text = decode(context + token_ids, skip_special_tokens=skip)
        if text.startswith(prev_text) and REPLACEMENT_CHAR not in text[len(prev_text):]:
            return text[len(prev_text):]
        return IncrementalDetokenizer.decode_all(self, token_ids, flush)

    def _resync(self) -> str:
        """Emits the pending ids' text as it decodes now and restarts the stream after them."""
        skip = self.skip_special_tokens
        prev_text = self.backend.decode(self._prev_ids, skip_special_tokens=skip)
        text = self.backend.decode(self._prev_ids + self._pending_ids, skip_special_tokens=skip)
        if not text.startswith(prev_text):
            self._warn_once("decoder is not prefix-stable: %r is not a prefix of %r",
                            prev_text, text)
        context = _trim_incomplete_tail(self.backend, self._pending_ids, self.skip_special_tokens)
        self._prev_ids = context
        self._pending_ids = []
        self._stream = _new_stream(self.backend, context, self.skip_special_tokens)
        return text[len(prev_text):]

    def _warn_once(self, msg: str, *args: object) -> None:
        # once per request: a model stuck emitting invalid bytes would otherwise flood the log
        if not self._warned:
            self._warned = True
            logger.warning(msg, *args)


def _prompt_context(prompt_token_ids: Sequence[int]) -> list[int]:
    # int(): prompts may arrive as numpy/torch integers, which DecodeStream does not take
    return [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]


def _new_stream(backend: Any, context: list[int], skip_special_tokens: bool) -> Any:
    if context:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    return DecodeStream(skip_special_tokens=skip_special_tokens)


def _trim_incomplete_tail(backend: Any, context: list[int], skip_special_tokens: bool) -> list[int]:
    """Drops context ids from the end while they decode to an unfinished character.

    A DecodeStream seeded with such ids keeps an empty prefix and would emit the context's own text
    with the first output chunk.
    """
    context = list(context)
    while context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(
            REPLACEMENT_CHAR):
        context.pop()
    return context


@dataclass(slots=True, eq=False)
class TokenWindowDetokenizer(IncrementalDetokenizer):
    """:class:`IncrementalDetokenizer` over ``convert_ids_to_tokens``/``convert_tokens_to_string``.

    The classic prefix/read-offset method. ``_tokens`` holds the window only: the tokens of the
    last emitted chunk (``_tokens[:_read_offset]``, text ``_prefix_text``) and the pending ones.
    """

    tokenizer: Any
    skip_special_tokens: bool
    spaces_between_special_tokens: bool | None
    _special_ids: frozenset[int]
    # tokens decoded as pieces of their own when spaces_between_special_tokens is a bool
    _added_tokens: frozenset[str]
    _tokens: list[str]
    _read_offset: int
    _prefix_text: str
    _warned: bool = False

    @classmethod
    def new(cls, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
            spaces_between_special_tokens: bool | None) -> TokenWindowDetokenizer:
        special_ids = _skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        added = (frozenset(tokenizer.get_added_vocab())
                 if spaces_between_special_tokens is not None else frozenset())
        self = cls(tokenizer, skip_special_tokens, spaces_between_special_tokens, special_ids,
                   added, [], 0, "")
        tokens = self._to_tokens(_prompt_context(prompt_token_ids))
        # same reason as _trim_incomplete_tail: a context ending mid-character would leak
        while tokens and self._to_string(tokens).endswith(REPLACEMENT_CHAR):
            tokens.pop()
        self._tokens = tokens
        self._read_offset = len(tokens)
        self._prefix_text = self._to_string(tokens)
        return self

    def update(self, new_token_ids: Iterable[int]) -> str:
        pieces: list[str] = []
        tokens = self._tokens
        for token in self._to_tokens(new_token_ids):
            tokens.append(token)
            text = self._to_string(tokens)
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                pieces.append(self._advance(text))
                tokens = self._tokens
            elif len(tokens) - self._read_offset > MAX_PENDING_TOKENS:
                if not self._warned:
                    self._warned = True
                    logger.warning("%d tokens without a complete character; emitting U+FFFD",
                                   len(tokens) - self._read_offset)
                pieces.append(self._advance(text))
                tokens = self._tokens
        return "".join(pieces)

    def flush(self) -> str:
        if len(self._tokens) == self._read_offset:
            return ""
        return self._advance(self._to_string(self._tokens))

    def _advance(self, text: str) -> str:
        """Emits ``text`` (the whole window's) past the prefix; pending tokens become the prefix."""
        delta = text[len(self._prefix_text):]
        self._tokens = self._tokens[self._read_offset:]
        self._read_offset = len(self._tokens)
        self._prefix_text = self._to_string(self._tokens)
        return delta

    def _to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        convert = self.tokenizer.convert_ids_to_tokens
        special = self._special_ids
        tokens: list[str] = []
        for token_id in token_ids:
            if token_id in special:
                continue
            token = convert(token_id)
            # ids past the vocabulary (models pad their LM head) have no token; decode drops them
            if token is not None:
                tokens.append(token)
        return tokens

    def _to_string(self, tokens: list[str]) -> str:
        if self.spaces_between_special_tokens is None:
            return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""
        added = self._added_tokens
        pieces: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in added:
                if run:
                    pieces.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(pieces)


def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops, read once (not per token)."""
    backend = _backend_of(tokenizer)
    if backend is not None:
        # a fast tokenizer's decode skips every added token marked special, which can be more
        # than all_special_ids (SmolLM2's "<repo_name>" and friends)
        return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return frozenset(tokenizer.all_special_ids)


@dataclass(slots=True, eq=False)
class _TokenTextCache:
    """Per tokenizer: the anchor that gives decode_token its context, and the texts so far."""

    anchor_ids: list[int]
    anchor_text: str
    texts: dict[int, str] = field(default_factory=dict)


_TOKEN_TEXT_CACHES: weakref.WeakKeyDictionary[Any, _TokenTextCache] = weakref.WeakKeyDictionary()


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token, for logprob entries; special tokens are kept.

    Decoded as a continuation of plain text, as in running text: ``"▁Hello"`` (Metaspace) gives
    ``" Hello"`` where ``decode([token_id])`` drops the space; a WordPiece ``"##ing"`` gives
    ``"ing"`` and a WordPiece word ``" word"``. Byte-level tokens give what ``decode`` gives. A token that is only part of a multi-byte character gives
    U+FFFD, as the tokenizer's own decode does. Results are memoised per tokenizer.
    """
    cache = _token_text_cache(tokenizer)
    text = cache.texts.get(token_id)
    if text is None:
        text = _decode_ids(tokenizer, cache.anchor_ids + [token_id])
        if cache.anchor_ids and text.startswith(cache.anchor_text):
            text = text[len(cache.anchor_text):]
        else:
            text = _decode_ids(tokenizer, [token_id])
        cache.texts[token_id] = text
    return text


def _token_text_cache(tokenizer: Any) -> _TokenTextCache:
    try:
        cache = _TOKEN_TEXT_CACHES.get(tokenizer)
    except TypeError:  # unhashable or not weak-referenceable: works, just without the memo
        cache = None
    if cache is None:
        # "a" is plain text in every vocabulary; where the anchor's text changes once a token
        # follows it, the startswith check in decode_token falls back to decoding the token alone
        anchor_ids = _encode_plain(tokenizer, "a")
        anchor_text = _decode_ids(tokenizer, anchor_ids) if anchor_ids else ""
        cache = _TokenTextCache(anchor_ids, anchor_text)
        try:
            _TOKEN_TEXT_CACHES[tokenizer] = cache
        except TypeError:
            pass
    return cache


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    if BackendTokenizer is not None and isinstance(tokenizer, BackendTokenizer):
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode_ids(tokenizer: Any, token_ids: list[int]) -> str:
    if BackendTokenizer is not None and isinstance(tokenizer, BackendTokenizer):
        return tokenizer.decode(token_ids, skip_special_tokens=False)
    return tokenizer.decode(token_ids, skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
