"""Stored responses of ``/v1/responses``, for ``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}``, its ``input_items`` and background responses' progress: in memory, per
API server process, bounded in entries and in bytes, the least recently used evicted first.

Each entry keeps the whole conversation up to and including its output (as chat-template
messages), so a follow-up needs one lookup and no chain of ancestors that may have been evicted
meanwhile; the byte bound covers that repetition.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 64 << 20


# A follow-up (previous_response_id) may continue a response of these statuses.
CONTINUABLE = frozenset({"completed", "incomplete"})
# A background response still generating: never evicted (their number is bounded apart).
RUNNING = frozenset({"queued", "in_progress"})


@dataclass(slots=True, frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation, without the request's instructions
    body: bytes  # the response object as JSON, for GET
    size: int  # bytes charged against the store's bound
    # The request's own input items (ids given), for GET /v1/responses/{id}/input_items.
    input_items: list[dict[str, Any]] = field(default_factory=list)
    status: str = "completed"  # the body's: a background response is stored while it runs


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response_id: str, messages: list[dict[str, Any]], body: bytes,
            input_items: list[dict[str, Any]] | None = None, status: str = "completed") -> bool:
        """Keep the response (in place of an earlier entry of that id, evicting the least
        recently used to make room); False if it alone is over the byte bound or storing is
        off (a bound of 0)."""
        items = input_items or []
        size = len(body) + len(msgspec.json.encode(messages)) + len(msgspec.json.encode(items))
        self.delete(response_id)  # (an earlier state of it must not outlive a failed put)
        if self.max_entries == 0 or size > self.max_bytes:
            logger.debug("response %s not stored (%d bytes; store bound %d bytes)", response_id,
                         size, self.max_bytes)
            return False
        if len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes:
            for old_id in [k for k, v in self._entries.items() if v.status not in RUNNING]:
                if len(self._entries) < self.max_entries and \
                        self._bytes + size <= self.max_bytes:
                    break
                self._bytes -= self._entries.pop(old_id).size
                logger.debug("response store full: evicted %s", old_id)
        self._entries[response_id] = StoredResponse(messages, body, size, items, status)
        self._bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
