"""The data-parallel coordinator: routing by load (reported, and sent since the report), KV
usage on a tie of that, prefix-cache affinity on a tie of both, owners released."""

from __future__ import annotations

from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.dp_coordinator import WAITING_WEIGHT, DPCoordinator

BLOCK = 4


def test_least_loaded_rank_wins():
    coord = DPCoordinator(3, BLOCK)
    coord.report(0, SchedulerStats(num_running=5, num_waiting=0))
    coord.report(1, SchedulerStats(num_running=0, num_waiting=2))
    coord.report(2, SchedulerStats(num_running=3, num_waiting=0))
    # Waiting weighs more than running: rank 1's two queued requests outweigh rank 2's three
    # running ones.
    assert 2 * WAITING_WEIGHT > 3
    assert coord.pick([1, 2]) == 2
    coord.report(2, SchedulerStats(num_running=9, num_waiting=0))
    assert coord.pick([1, 2]) == 0


def test_requests_sent_since_the_report_count_as_waiting():
    """A burst between two reports spreads instead of piling onto the rank that looked idle."""
    coord = DPCoordinator(2, BLOCK)
    ranks = [coord.route(f"r{i}", [i]) for i in range(6)]
    assert ranks.count(0) == ranks.count(1) == 3
    assert [r.in_flight for r in coord.ranks] == [3, 3]
    # A report counts what had been sent: the local count starts again from it.
    coord.report(0, SchedulerStats(num_running=3))
    assert coord.ranks[0].sent_since_report == 0 and coord.ranks[1].sent_since_report == 3
    assert coord.pick([7]) == 0


def test_kv_usage_breaks_ties_of_queue_load():
    coord = DPCoordinator(2, BLOCK)
    coord.report(0, SchedulerStats(num_running=1, kv_cache_usage=0.8))
    coord.report(1, SchedulerStats(num_running=1, kv_cache_usage=0.1))
    assert coord.pick([1, 2, 3, 4, 5]) == 1


def test_prefix_affinity_on_a_tie():
    """Prompts sharing their first block prefer one rank while loads tie; a salt changes
    which; a prompt shorter than a block has no preference (the tied ranks take turns)."""
    coord = DPCoordinator(4, BLOCK)
    prefix = [11, 12, 13, 14]
    preferred = coord.preferred_rank(prefix + [1], None)
    assert preferred is not None
    assert {coord.pick(prefix + [t]) for t in range(20)} == {preferred}
    salted = {coord.preferred_rank(prefix, f"salt{i}") for i in range(16)}
    assert len(salted) > 1
    # The same in another process's coordinator (no per-process hash seed).
    assert DPCoordinator(4, BLOCK).preferred_rank(prefix, None) == preferred
    assert coord.preferred_rank([1, 2, 3], None) is None
    assert {coord.pick([1, 2, 3]) for _ in range(8)} == {0, 1, 2, 3}
    # Load beats affinity.
    coord.report(preferred, SchedulerStats(num_running=1))
    assert coord.pick(prefix) != preferred


def test_release_forgets_the_owner():
    coord = DPCoordinator(2, BLOCK)
    rank = coord.route("a", [1])
    assert coord.owner("a") == rank
    assert coord.release("a") == rank and coord.owner("a") is None
    assert coord.release("a") is None
    assert coord.ranks[rank].in_flight == 0
