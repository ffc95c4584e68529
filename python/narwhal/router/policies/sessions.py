"""Conversations kept on their engine: a bounded map from routing key to engine name."""

from __future__ import annotations

from collections import OrderedDict


class Sessions:
    """The engine each recent conversation was last placed on (least recently seen out)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._engine: OrderedDict[str, str] = OrderedDict()

    def engine(self, key: str | None) -> str | None:
        if key is None:
            return None
        return self._engine.get(key)

    def recent(self) -> list[tuple[str, str]]:
        """Every conversation kept, least recently seen first."""
        return list(self._engine.items())

    def placed(self, key: str | None, engine: str) -> None:
        if key is None:
            return
        self._engine[key] = engine
        self._engine.move_to_end(key)
        if len(self._engine) > self.capacity:
            self._engine.popitem(last=False)
