"""``/metrics``' speculative-decoding off-switch counter: steps whose drafts were dropped, by
reason (batch_size | acceptance), next to vLLM's spec_decode_* counters, also when an
undelivered report was folded into a later one; absent without speculative decoding."""

from __future__ import annotations

import re

from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.output_processor import StepRecord
from tidal.frontend.server.metrics import ServerMetrics

_OFF = re.compile(r'^tidal:spec_decode_off_steps_total\{(.*)\} (\S+)$', re.M)


def _off_steps(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for labels, value in _OFF.findall(m.render().decode()):
        reason = re.search(r'reason="(\w+)"', labels)
        assert reason and 'engine="0"' in labels and 'model_name="tiny"' in labels, labels
        out[reason.group(1)] = float(value)
    return out


def test_off_steps_counted_by_reason():
    m = ServerMetrics("tiny", speculative=True)
    m.observe_step(SchedulerStats(spec_off_steps_batch_size=2), StepRecord(engine_index=0))
    assert _off_steps(m) == {"batch_size": 2.0}
    later = SchedulerStats(spec_num_drafts=1, spec_num_draft_tokens=4,
                           spec_num_accepted_tokens=1, spec_accepted_per_pos=[1, 0, 0, 0],
                           spec_off_steps_acceptance=3)
    later.add_counters(SchedulerStats(spec_off_steps_batch_size=1, spec_off_steps_acceptance=4))
    m.observe_step(later, StepRecord(engine_index=0))
    assert _off_steps(m) == {"batch_size": 3.0, "acceptance": 7.0}
    assert "# TYPE tidal:spec_decode_off_steps_total counter" in m.render().decode()
    plain = ServerMetrics("tiny")
    plain.observe_step(SchedulerStats(spec_off_steps_batch_size=2), StepRecord(engine_index=0))
    assert "spec_decode_off_steps" not in plain.render().decode()
