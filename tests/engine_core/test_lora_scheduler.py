"""LoRA in the scheduler (no model runs): a running batch holds at most ``max_loras`` distinct
adapters, a request whose adapter would exceed that waits without holding up base-model or
already-running adapters' requests behind it, its turn comes when a slot frees (finish or
preemption), and prefix-cache blocks are never shared across adapters."""

from __future__ import annotations

import msgspec
import pytest

from tidal.engine_core.block_hash import BlockHasher
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.lora_config import LoRAConfig
from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason, ModelRunnerOutput
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.scheduler import Scheduler

EOS = 2


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


@pytest.fixture(scope="module")
def config(tiny_models):
    cfg = EngineArgs(model=str(tiny_models["llama"][0]), num_kv_blocks=64, max_num_seqs=8,
                     max_num_batched_tokens=256, max_model_len=256).create_config()
    return msgspec.structs.replace(cfg, lora=LoRAConfig(max_loras=2, max_cpu_loras=2))


def add(s: Scheduler, rid: str, adapter: int | None, n_prompt: int = 8,
        max_tokens: int = 4) -> Request:
    base = 10 + 100 * len(s.requests)
    req = Request.from_engine_request(
        EngineCoreRequest(rid, list(range(base, base + n_prompt)),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          lora_request=None if adapter is None else lora(adapter)),
        s.max_model_len, frozenset({EOS}))
    s.add_request(req)
    return req


def step(s: Scheduler):
    so = s.schedule()
    ids = [rid for rid in so.req_ids
           if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens]
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7]] * len(ids)))
    return so


def running_adapters(s: Scheduler) -> set[int]:
    return {r.lora_int_id for r in s.running if r.lora_request is not None}


def test_at_most_max_loras_adapters_run(config):
    s = Scheduler(config)
    add(s, "a1", 1)
    add(s, "a2", 2)
    add(s, "a3", 3)  # a third adapter: waits
    add(s, "base", None)  # the base model needs no slot: passes it
    add(s, "a1b", 1)  # an adapter already running: passes it too
    so = step(s)
    assert {r.req_id for r in so.new_reqs} == {"a1", "a2", "base", "a1b"}
    assert [r.request_id for r in s.waiting] == ["a3"]
    assert running_adapters(s) == {1, 2}
    # The adapter travels to the workers with the request.
    assert {r.req_id: r.lora_request for r in so.new_reqs}["a2"] == lora(2)
    seen_max = 0
    while s.has_unfinished():
        step(s)
        seen_max = max(seen_max, len(running_adapters(s)))
    assert seen_max <= 2


def test_waiting_adapter_runs_once_a_slot_frees(config):
    s = Scheduler(config)
    add(s, "a1", 1, max_tokens=1)
    add(s, "a2", 2, max_tokens=50)
    add(s, "a3", 3)
    step(s)  # a1 and a2 run; a1 finishes on its first token
    assert "a1" not in s.requests and [r.request_id for r in s.waiting] == ["a3"]
    so = step(s)
    assert [r.req_id for r in so.new_reqs] == ["a3"]
    assert running_adapters(s) == {2, 3}


def test_preemption_frees_the_slot(config):
    s = Scheduler(config)
    add(s, "a1", 1, max_tokens=50)
    add(s, "a2", 2, max_tokens=50)
    add(s, "a3", 3)
    step(s)
    victim = s.running[-1]
    s.running.remove(victim)
    s._preempt(victim)  # as the KV pool running dry would
    # The preempted request is first in line again and gets its slot back before a3.
    so = step(s)
    assert [r.req_id for r in so.new_reqs] == [victim.request_id]
    assert [r.request_id for r in s.waiting] == ["a3"]
    s.finish_requests([victim.request_id], FinishReason.ABORT)
    so = step(s)
    assert [r.req_id for r in so.new_reqs] == ["a3"]


def test_block_hashes_differ_across_adapters(config):
    hasher = BlockHasher(16, seed=1)
    prompt = list(range(40))

    def hashes(adapter: LoRARequest | None, salt: str | None = None) -> list[bytes]:
        req = Request.from_engine_request(
            EngineCoreRequest("r", prompt, SamplingParams(), cache_salt=salt,
                              lora_request=adapter), 256, frozenset())
        return hasher.update(req)

    base, one, two = hashes(None), hashes(lora(1)), hashes(lora(2))
    assert len(base) == 2
    assert not (set(base) & set(one) or set(one) & set(two) or set(base) & set(two))
    assert hashes(lora(1)) == one  # deterministic: the same adapter shares its blocks
    # The same id at another path (re-registered for other weights) does not share them.
    assert not set(hashes(LoRARequest("a1", 1, "/elsewhere"))) & set(one)
    assert not set(hashes(lora(1), salt="s")) & set(one)
