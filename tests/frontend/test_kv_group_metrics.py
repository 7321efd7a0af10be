"""``/metrics``' per-KV-group usage gauge (models with sliding-window layers: one series per
group, labelled ``group``) next to the unlabelled total the dashboards read."""

from __future__ import annotations

from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.output_processor import StepRecord
from tidal.frontend.server.metrics import ServerMetrics


def test_group_usage_series_follow_the_engine_stats():
    m = ServerMetrics("tiny-gemma")
    m.observe_step(SchedulerStats(kv_cache_usage=0.5, kv_cache_usage_groups=[0.375, 0.125]),
                   StepRecord(engine_index=0))
    text = m.render().decode()
    total = [ln for ln in text.splitlines() if ln.startswith("tidal:kv_cache_usage_perc{")]
    assert total == ['tidal:kv_cache_usage_perc{engine="0",model_name="tiny-gemma"} 0.5']
    groups = {ln.split('group="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
              for ln in text.splitlines() if ln.startswith("tidal:kv_cache_group_usage_perc{")}
    assert groups == {"0": 0.375, "1": 0.125}
    # A model with one group reports no group series at all.
    plain = ServerMetrics("tiny-llama")
    plain.observe_step(SchedulerStats(kv_cache_usage=0.25), StepRecord(engine_index=0))
    assert "tidal:kv_cache_group_usage_perc{" not in plain.render().decode()
