"""A thread-safe LRU map: the compiled-grammar caches of the guided backends and of the JSON layouts.

The compile thread fills it while the step thread looks entries up, so every
access holds the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Optional


class LRUCache:
    """At most ``capacity`` entries; a lookup makes its entry the most recent, a new one evicts the least.

    Raises ``ValueError`` for a ``capacity`` below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Optional[Any]:
        """The entry of ``key``, made the most recent; None if absent."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        return None

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key`` as the most recent entry, evicting the least recent beyond the capacity."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
