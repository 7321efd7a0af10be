"""The consumer's background pulls: a P2P KV load runs off the decode step's critical path.

The step thread queues a pull (``submit``) and goes on; one pull thread runs them in order
through the ``KVPullClient`` (which it alone uses, releases included), writing only into the
blocks the scheduler allocated to that request, which no step touches until the request is
reported in ``take_finished``. With a GPU cache the thread copies on its own CUDA stream,
first waiting for an event recorded on the step thread's stream at ``submit`` (earlier steps
may still write those blocks for their previous owner), and synchronizes that stream before a
pull counts as done. A failed or cancelled pull is reported done too, with its blocks in the
invalid set: the scheduler then recomputes the request (never runs it on unfilled blocks).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from tidal.engine_core.kv_transfer.p2p_transport import KVPullClient, KVTransferError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PullJob:
    request_id: str
    address: str
    remote_request_id: str
    start_block: int
    block_ids: list[int]  # empty: only release the producer's blocks (nothing to load)
    digest: str
    after: torch.cuda.Event | None = None  # the step thread's stream reached this point


@dataclass(slots=True)
class _Results:
    done: set[str] = field(default_factory=set)
    invalid: set[int] = field(default_factory=set)


class AsyncPuller:
    def __init__(self, client: KVPullClient) -> None:
        self.client = client
        self._jobs: queue.SimpleQueue[PullJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._results = _Results()
        # Submitted and not yet done, and of those the ones the scheduler dropped: both
        # shrink as pulls end (ids are only reused once their pull is over).
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()
        self.failed = 0
        self.completed = 0
        device = client.kv_caches[0].device if client.kv_caches else torch.device("cpu")
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="kv-pull", daemon=True)
        self._thread.start()

    # --- step thread -------------------------------------------------------------------------

    def submit(self, job: PullJob) -> None:
        if self._stream is not None and job.block_ids:
            job.after = torch.cuda.Event()
            job.after.record(torch.cuda.current_stream(self._device))
        if job.block_ids:
            with self._lock:
                self._pending.add(job.request_id)
        self._jobs.put(job)

    def cancel(self, request_ids: list[str]) -> None:
        """The scheduler dropped these requests: a pull of theirs not started yet is skipped
        (reported done, its blocks invalid). Ids with no pull pending are ignored (every
        finished request of every step comes here)."""
        if request_ids:
            with self._lock:
                if self._pending:
                    self._cancelled.update(self._pending.intersection(request_ids))

    def take_finished(self) -> tuple[set[str], set[int]]:
        """(Requests whose pull ended since the last call, blocks left unfilled by those that
        failed): taken together, so a failure is reported with its request."""
        with self._lock:
            results, self._results = self._results, _Results()
        return results.done, results.invalid

    def close(self) -> bool:
        """Stop the pull thread after its current job (bounded by the client's timeouts).
        True: it stopped, and the caller may close the client (its sockets are the thread's
        until then); False: it is stuck, the client must be left alone (a daemon thread)."""
        self._jobs.put(None)
        self._thread.join(timeout=self.client.timeout_s + 5.0)
        if self._thread.is_alive():
            logger.warning("the KV pull thread did not stop in time; leaving it (daemon)")
            return False
        return True

    # --- pull thread -------------------------------------------------------------------------

    def _run(self) -> None:
        # Nothing may kill this thread silently: a parked request waits for its report.
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
        except Exception:  # noqa: BLE001 - its pulls then fail (and recompute) one by one
            logger.exception("the KV pull thread could not select %s", self._device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not job.block_ids:
                try:
                    self.client.release(job.address, job.remote_request_id, job.digest)
                except Exception:  # noqa: BLE001 - the producer's timeout frees them anyway
                    logger.exception("releasing the KV of request %s failed", job.request_id)
                continue
            ok = False
            try:
                ok = self._pull(job)
            except Exception:  # noqa: BLE001 - a cancelled job's release; reported below
                logger.exception("the KV pull job of request %s failed", job.request_id)
            finally:  # (whatever ends it, the request hears of it)
                self._done(job, ok)

    def _done(self, job: PullJob, ok: bool) -> None:
        with self._lock:
            self._pending.discard(job.request_id)
            self._cancelled.discard(job.request_id)
            self._results.done.add(job.request_id)
            if not ok:
                self._results.invalid.update(job.block_ids)

    def _pull(self, job: PullJob) -> bool:
        with self._lock:
            cancelled = job.request_id in self._cancelled
        if cancelled:  # nobody needs it: the producer may free the blocks now
            self.client.release(job.address, job.remote_request_id, job.digest)
            return False
        try:
            if self._stream is None:
                self.client.pull(job.address, job.remote_request_id, job.start_block,
                                 job.block_ids, job.digest)
            else:
                with torch.cuda.stream(self._stream):
                    if job.after is not None:
                        self._stream.wait_event(job.after)
                    self.client.pull(job.address, job.remote_request_id, job.start_block,
                                     job.block_ids, job.digest)
                self._stream.synchronize()
        except KVTransferError as exc:
            self.failed += 1
            logger.warning("pulling the KV of request %s from %s failed (%s); it is "
                           "recomputed here", job.request_id, job.address, exc)
            return False
        except Exception:  # noqa: BLE001 - the thread must live on; the request recomputes
            self.failed += 1
            logger.exception("pulling the KV of request %s failed", job.request_id)
            return False
        self.completed += 1
        return True
