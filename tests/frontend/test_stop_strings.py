"""Stop strings: the streamed text equals the full text cut at the first stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.frontend.detokenizer import create_detokenizer
from tidal.frontend.stop_strings import StopCheck, StopStringMatcher



def reference(full_text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """The full text cut at the earliest occurrence of any stop string (at equal starts, the
    shortest: it completes first), and that stop string."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = full_text.find(s)
        if i >= 0 and (best is None or (i, len(s)) < best[:2]):
            best = (i, len(s), s)
    if best is None:
        return full_text, None
    start, length, s = best
    return full_text[:start + length if include else start], s


def run(stops: Sequence[str] | str, chunks: Sequence[str], include: bool = False,
        ) -> tuple[list[str], str | None]:
    """Streams chunks as a frontend would: feed until a stop, else finish at the end."""
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted: list[str] = []
    for chunk in chunks:
        check = matcher.feed(chunk)
        emitted.append(check.text)
        if check.stopped:
            return emitted, check.stop
    check = matcher.finish()
    emitted.append(check.text)
    return emitted, check.stop


def check_against_reference(stops: Sequence[str], chunks: Sequence[str], include: bool) -> None:
    emitted, stop = run(stops, chunks, include)
    expected, expected_stop = reference("".join(chunks), stops, include)
    assert ("".join(emitted), stop) == (expected, expected_stop)
    if stop is not None and not include:
        assert stop not in "".join(emitted)


# --- examples ---------------------------------------------------------------------------------

def test_single_stop_in_one_delta() -> None:
    assert run(["STOP"], ["Hello STOP world"]) == (["Hello "], "STOP")
    assert run(["STOP"], ["Hello STOP world"], include=True) == (["Hello STOP"], "STOP")


def test_stop_spanning_deltas_is_held_then_cut() -> None:
    emitted, stop = run(["<|end|>"], ["Answer: 42 <|", "en", "d|> trailing"])
    # "<|" and "<|en" could begin the stop string: never streamed
    assert emitted == ["Answer: 42 ", "", ""] and stop == "<|end|>"
    emitted, stop = run(["<|end|>"], ["Answer: 42 <|", "en", "d|> trailing"], include=True)
    assert emitted == ["Answer: 42 ", "", "<|end|>"] and stop == "<|end|>"


def test_partial_match_that_fails_is_released() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.feed("a <|en") == StopCheck("a ")
    assert matcher.held_text == "<|en"
    # the held text turns out not to be the stop string: released with the new text, except a
    # new tail that could again begin it
    assert matcher.feed("x <") == StopCheck("<|enx ")
    assert matcher.held_text == "<"
    assert matcher.feed("<|end") == StopCheck("<")
    assert matcher.feed("|> done") == StopCheck("", "<|end|>")


def test_held_text_is_flushed_at_finish() -> None:
    matcher = StopStringMatcher(["\n\nUser:"])
    assert matcher.feed("Bye.\n\nUs") == StopCheck("Bye.")
    assert matcher.finish() == StopCheck("\n\nUs")
    assert matcher.matched is None


def test_multiple_stops_earliest_wins() -> None:
    check_against_reference(["world", "lo"], ["hel", "lo wor", "ld"], False)
    # "l" could begin "lo", so it waits one delta
    assert run(["world", "lo"], ["hel", "lo wor", "ld"]) == (["he", "l"], "lo")
    assert run(["END", "\n"], ["a\nb END"]) == (["a"], "\n")


def test_stop_that_is_a_prefix_of_another() -> None:
    # both start at the same place: the shorter completes first and wins
    assert run(["stopping", "stop"], ["we ", "sto", "pping now"]) == (["we ", "", ""], "stop")
    assert run(["stop", "stopping"], ["we stopping now"], include=True) == (["we stop"], "stop")
    # the longer one occurs alone
    assert run(["stop!", "stop"], ["no st", "op! here"], include=True) == (["no ", "stop"], "stop")


def test_longer_stop_starting_earlier_is_waited_for() -> None:
    # "bc" completes while "abcd" (starting one character earlier) still may: wait
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xab") == StopCheck("x")
    assert matcher.feed("c") == StopCheck("")
    assert matcher.held_text == "abc"
    assert matcher.feed("d tail") == StopCheck("", "abcd")
    # ...and when it does not complete, the shorter match stands
    assert run(["abcd", "bc"], ["xab", "c", "z"]) == (["x", "", "a"], "bc")
    # a match waiting at the end of the request is applied by finish()
    assert run(["abcd", "bc"], ["xab", "c"]) == (["x", "", "a"], "bc")


def test_match_at_the_very_first_delta() -> None:
    assert run(["Hi"], ["Hi there"]) == ([""], "Hi")
    assert run(["Hi"], ["H", "i there"]) == (["", ""], "Hi")
    assert run(["Hi"], ["Hi there"], include=True) == (["Hi"], "Hi")


def test_after_a_stop_nothing_more_is_emitted() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("One. Two.") == StopCheck("One", ".")
    assert matcher.feed("Three") == StopCheck("", ".")
    assert matcher.finish() == StopCheck("", ".")
    assert matcher.matched == "."


def test_no_stops_passes_text_through_untouched() -> None:
    for stops in ([], None, [""]):
        matcher = StopStringMatcher(stops)
        assert matcher.feed("<|end|> anything") == StopCheck("<|end|> anything")
        assert matcher.finish() == StopCheck("")


def test_stop_given_as_a_plain_string_and_duplicates() -> None:
    matcher = StopStringMatcher("END")
    assert matcher.stop == ("END",)
    assert matcher.feed("abc END") == StopCheck("abc ", "END")
    assert StopStringMatcher(["x", "", "x", "y"]).stop == ("x", "y")


def test_unicode_stop_strings() -> None:
    check_against_reference(["👍🏽", "。"], ["你好", "👍", "🏽 more"], False)
    assert run(["👍🏽"], ["ok 👍", "🏽"], include=True) == (["ok ", "👍🏽"], "👍🏽")
    assert run(["。"], ["你好，", "世界。東京"]) == (["你好，", "世界"], "。")


def test_held_text_never_exceeds_longest_stop_minus_one() -> None:
    # the hot path only rescans this tail, so it must stay bounded
    stops = ["aaab", "ab", "xyzxyz"]
    matcher = StopStringMatcher(stops)
    for chunk in ["aa", "aaaa", "xyzxy", "zxy", "a", "xyzx"] * 5:
        matcher.feed(chunk)
        assert len(matcher.held_text) <= max(map(len, stops)) - 1


# --- property test ----------------------------------------------------------------------------

ALPHABET = "ab c\n"


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=12),
    include=st.booleans(),
)
def test_property_stream_equals_reference(text: str, stops: list[str], cuts: list[int],
                                          include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    check_against_reference(stops, chunks, include)
    # nothing is lost or duplicated on the way: emitted + held is always the text so far
    matcher = StopStringMatcher(stops, include)
    seen = emitted = ""
    for chunk in chunks:
        seen += chunk
        check = matcher.feed(chunk)
        emitted += check.text
        if check.stopped:
            break
        assert emitted + matcher.held_text == seen
        assert len(matcher.held_text) <= max(map(len, stops), default=1) - 1


# --- with a real tokenizer --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(qwen3_tokenizer: Any, smollm2_tokenizer: Any) -> dict[str, Any]:
    return {"qwen3": qwen3_tokenizer, "smol": smollm2_tokenizer}


OUTPUT = ("The answer is 42.\nObservation: 你好，世界 👍🏽 done.\n\nUser: next question?"
          "<|im_end|>")
STOP_CASES = [
    (["\n\nUser:"], False),
    (["\n\nUser:"], True),
    (["Observation:", "User:"], False),
    (["👍🏽"], True),
    (["界 👍"], False),
    (["nope", "never"], False),
    (["42.\nObs", "42"], True),
]


@pytest.mark.parametrize("name", ["qwen3", "smol"])
@pytest.mark.parametrize(("stops", "include"), STOP_CASES)
def test_detokenizer_and_stop_strings_token_by_token(
        tokenizers: dict[str, Any], name: str, stops: list[str], include: bool) -> None:
    tok = tokenizers[name]
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    detok = create_detokenizer(tok, tok.encode("Question:", add_special_tokens=False))
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted: list[str] = []
    check = StopCheck("")
    used = 0
    for token_id in ids:
        used += 1
        check = matcher.feed(detok.update([token_id]))
        emitted.append(check.text)
        if check.stopped:
            break
    else:
        check = matcher.feed(detok.flush())
        emitted.append(check.text)
        if not check.stopped:
            check = matcher.finish()
            emitted.append(check.text)
    expected, expected_stop = reference(full, stops, include)
    assert "".join(emitted) == expected
    assert check.stop == expected_stop
    assert all("\ufffd" not in e for e in emitted)
    if expected_stop is not None:
        # the request stops on the token that completes the stop string, not later
        assert tok.decode(ids[:used - 1], skip_special_tokens=True).find(expected_stop) < 0
        assert expected_stop in tok.decode(ids[:used], skip_special_tokens=True)
        # and the stop string is spread over several tokens, so several deltas
        assert not any(expected_stop in tok.decode([i]) for i in ids)
