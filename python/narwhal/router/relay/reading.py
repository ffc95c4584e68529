"""What an answer's mode (`stream`, `push`, `assemble`, `passthrough`) uses of the relayer:
the upstream read bounded by the deadline and the idle gap, the error event that ends a
stream out of time, and the native path's switches. Declared here, so the modes sit below
the relayer that dispatches to them (`relayer.Relayer` is the one implementation)."""

from __future__ import annotations

from typing import Protocol

from narwhal.router.connection import Exchange
from narwhal.router.lease import Lease


class Reading(Protocol):
    @property
    def idle_s(self) -> float: ...

    @property
    def native(self) -> bool: ...

    async def read(self, lease: Lease, resp: Exchange) -> bytes: ...

    def timed_out(self, lease: Lease) -> bytes: ...

    def count_path(self, path: str) -> None: ...

    def warn_not_native(self) -> None: ...
