"""``responses_truncation.truncate``: the fewest oldest turns dropped, whole turns only (a tool
call's results go with it), the leading system / developer messages kept, a bisection's number
of renders, and the shortest candidate when nothing fits."""

from __future__ import annotations

import asyncio
from typing import Any

from tidal.frontend.server.responses_truncation import fits, truncate, turn_starts


def _conversation(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s" * 5},
                                  {"role": "developer", "content": "d" * 5}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"u{t}" + "x" * 8},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{t}"}]},
                 {"role": "tool", "content": "r" * 5, "tool_call_id": f"c{t}"},
                 {"role": "assistant", "content": "a" * 10}]
    return msgs


class Render:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        self.calls += 1
        return [0] * sum(len(m["content"]) for m in messages)


def _run(messages, limit, max_tokens=5):
    render = Render()

    async def go():
        ids = await render(messages)
        return await truncate(messages, ids, render, max_tokens, limit)

    out = asyncio.run(go())
    return out, render.calls - 1


def test_turn_starts_and_fits():
    msgs = _conversation(3)
    assert turn_starts(msgs) == (2, [6, 10])
    assert fits(10, 5, 16) and not fits(12, 5, 16) and not fits(16, None, 16)
    assert fits(15, None, 16)


def test_the_fewest_oldest_turns_go_whole():
    msgs = _conversation(20)  # 10 pinned characters; turns 10 to 19 have 26 each
    (kept, ids, dropped), renders = _run(msgs, limit=10 + 26 * 6 + 5)
    assert dropped == 14 * 4  # 14 turns of 4 messages: 6 fit with the output's 5
    assert kept[:2] == msgs[:2] and kept[2]["content"].startswith("u14")
    assert len(ids) == 10 + 26 * 6
    assert all(m["role"] != "tool" or any(
        c.get("tool_calls") and c["tool_calls"][0]["id"] == m["tool_call_id"] for c in kept)
        for m in kept)
    assert renders <= 6  # bisection over 19 cut points


def test_nothing_to_drop_or_nothing_fits():
    msgs = _conversation(1)
    (kept, ids, dropped), renders = _run(msgs, limit=5)
    assert (kept, dropped, renders) == (msgs, 0, 0)  # one turn: nothing can go
    msgs = _conversation(4)
    (kept, ids, dropped), _ = _run(msgs, limit=20)  # even the last turn alone is too long
    assert kept[2]["content"].startswith("u3") and dropped == 12
    (kept, ids, dropped), renders = _run(msgs, limit=1000)
    assert (kept, dropped, renders) == (msgs, 0, 0)  # fits already


def test_instructions_before_a_question_stay_with_it():
    """A follow-up's own developer / system messages open its turn: a cut before the question
    keeps them (they are not the previous turn's to drop)."""
    msgs = [{"role": "system", "content": "s" * 5}, {"role": "user", "content": "u" * 30},
            {"role": "assistant", "content": "a" * 30},
            {"role": "developer", "content": "NEW RULES"}, {"role": "user", "content": "q"}]
    assert turn_starts(msgs) == (1, [3])
    (kept, ids, dropped), _ = _run(msgs, limit=30)
    assert [m["content"] for m in kept] == ["s" * 5, "NEW RULES", "q"] and dropped == 2


def test_no_cut_is_tried_when_the_output_alone_fills_the_context():
    msgs = _conversation(6)
    (kept, ids, dropped), renders = _run(msgs, limit=50, max_tokens=50)
    assert (kept, dropped, renders) == (msgs, 0, 0)
