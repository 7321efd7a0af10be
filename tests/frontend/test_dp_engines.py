"""Each data-parallel rank's config and GPUs (no processes), stopping the ranks (fake
processes), and the flags that refuse data parallelism where it is not supported."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tidal.engine_core.config import ConfigError, EngineArgs, ParallelConfig
from tidal.frontend.dp_engines import DPEngine, rank_devices, stop_dp_engines


def _config(device: str, dp: int, tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(runner=SimpleNamespace(device=device),
                           parallel=ParallelConfig(tensor_parallel_size=tp,
                                                   data_parallel_size=dp))


def test_each_rank_gets_its_own_slice_of_the_gpus():
    assert rank_devices(_config("cuda", 2, tp=2), visible="4,5,6,7") == ["4,5", "6,7"]
    assert rank_devices(_config("cuda", 2), device_count=3) == ["0", "1"]
    assert rank_devices(_config("cpu", 3)) == [None, None, None]
    with pytest.raises(ConfigError, match="needs 4 GPUs; 3 visible"):
        rank_devices(_config("cuda", 2, tp=2), visible="0,1,2")


def test_data_parallel_size_is_bounded(tiny_models):
    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), data_parallel_size=2).create_config()
    assert config.parallel.data_parallel_size == 2 and config.parallel.data_parallel_rank == 0
    for bad in (0, 65):
        with pytest.raises(ConfigError, match="data_parallel_size"):
            EngineArgs(model=str(folder), data_parallel_size=bad).create_config()


def test_where_data_parallelism_is_refused(tiny_models, caplog):
    from tidal.engine_core.cli import main as engine_core_main
    from tidal.frontend import LLM

    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="not yet supported by the offline LLM"):
        LLM(str(folder), data_parallel_size=2)
    assert engine_core_main(["--model", str(folder), "--data-parallel-size", "2"]) == 2
    assert "not yet supported" in caplog.text


class _SlowProc:
    """A rank's process that exits ``need_s`` after SIGTERM (never, if None)."""

    def __init__(self, need_s: float | None) -> None:
        self.need_s = need_s
        self.pid = 0
        self.termed: float | None = None
        self.killed = False

    def is_alive(self) -> bool:
        if self.killed:
            return False
        return self.termed is None or self.need_s is None \
            or time.monotonic() - self.termed < self.need_s

    def terminate(self) -> None:
        self.termed = time.monotonic()

    def join(self, timeout: float | None = None) -> None:
        end = time.monotonic() + (timeout or 0.0)
        while self.is_alive() and time.monotonic() < end:
            time.sleep(0.01)

    def kill(self) -> None:
        self.killed = True


def test_every_rank_gets_the_whole_grace(tmp_path):
    # Rank 1 outlives its grace (killed); rank 0 needs a little of its own and must get it,
    # not what rank 1 left of a shared one.
    procs = [_SlowProc(0.1), _SlowProc(None)]
    engines = [DPEngine(i, p, "", str(tmp_path / str(i)), store=object())  # type: ignore[arg-type]
               for i, p in enumerate(procs)]
    stop_dp_engines(engines, 0.3)
    assert not procs[0].killed and procs[1].killed
    assert all(e.store is None for e in engines)  # the rendezvous store goes with them
