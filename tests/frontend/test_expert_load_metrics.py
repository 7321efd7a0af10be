"""``/metrics``' expert-load histogram (mixture-of-experts models): one counter series per
expert and engine, and with expert parallelism one per EP rank over its contiguous range of
experts; dense models have neither family."""

from __future__ import annotations

from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.output_processor import StepRecord
from tidal.frontend.server.metrics import ServerMetrics


def _series(text: str, family: str, label: str) -> dict[tuple[str, str], float]:
    out = {}
    for ln in text.splitlines():
        if ln.startswith(f"tidal:{family}_total{{"):
            engine = ln.split('engine="')[1].split('"')[0]
            key = ln.split(f'{label}="')[1].split('"')[0]
            out[(engine, key)] = float(ln.rsplit(" ", 1)[1])
    return out


def test_expert_and_ep_rank_counters_add_up_per_engine():
    m = ServerMetrics("tiny-moe", moe=True)
    m.observe_step(SchedulerStats(moe_expert_load=[3, 0, 5, 1], moe_ep_ranks=2),
                   StepRecord(engine_index=0))
    m.observe_step(SchedulerStats(moe_expert_load=[1, 1, 0, 0], moe_ep_ranks=2),
                   StepRecord(engine_index=0))
    m.observe_step(SchedulerStats(moe_expert_load=[0, 2, 0, 0], moe_ep_ranks=2),
                   StepRecord(engine_index=1))
    m.observe_step(SchedulerStats(), StepRecord(engine_index=1))  # nothing routed
    text = m.render().decode()
    assert _series(text, "moe_expert_load_tokens", "expert") == {
        ("0", "0"): 4.0, ("0", "1"): 1.0, ("0", "2"): 5.0, ("0", "3"): 1.0, ("1", "1"): 2.0}
    # EP rank 0 holds experts 0-1, rank 1 experts 2-3.
    assert _series(text, "moe_ep_rank_load_tokens", "ep_rank") == {
        ("0", "0"): 5.0, ("0", "1"): 6.0, ("1", "0"): 2.0}


def test_no_ep_rank_series_without_expert_parallelism_and_none_for_dense_models():
    m = ServerMetrics("tiny-moe", moe=True)
    m.observe_step(SchedulerStats(moe_expert_load=[2, 2], moe_ep_ranks=1),
                   StepRecord(engine_index=0))
    text = m.render().decode()
    assert _series(text, "moe_expert_load_tokens", "expert") == {("0", "0"): 2.0,
                                                                 ("0", "1"): 2.0}
    assert "tidal:moe_ep_rank_load_tokens_total{" not in text
    dense = ServerMetrics("tiny-llama")
    dense.observe_step(SchedulerStats(moe_expert_load=[1]), StepRecord(engine_index=0))
    assert "moe_expert_load" not in dense.render().decode()


def test_undelivered_reports_fold_their_expert_loads():
    later = SchedulerStats(moe_expert_load=[1, 2], moe_ep_ranks=2)
    later.add_counters(SchedulerStats(moe_expert_load=[4, 0, 1], moe_ep_ranks=2))
    assert (later.moe_expert_load, later.moe_ep_ranks) == ([5, 2, 1], 2)
