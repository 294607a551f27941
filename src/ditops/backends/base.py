"""The Backend protocol: a lazily probed optional library with an install hint."""

from __future__ import annotations

import threading
import weakref

_instances: weakref.WeakSet[Backend] = weakref.WeakSet()


def all_backends() -> list[Backend]:
    """Every Backend object created in this process."""
    return list(_instances)


class Backend:
    """An optional library a fast path needs.

    Subclasses implement :meth:`_probe`, returning the reasons the library cannot be
    used (empty when it can). The answer is cached for the process; :meth:`reset`
    forgets it (tests install and remove fake packages).
    """

    #: Short name used in explanations and warnings, e.g. ``"triton"``.
    name: str = "backend"
    #: What a user should do when the library is missing, e.g. ``pip install triton``.
    install_hint: str = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: list[str] | None = None
        _instances.add(self)

    def _probe(self) -> list[str]:
        raise NotImplementedError

    def probe(self) -> list[str]:
        """Reasons this backend is unusable in this process; empty when it is usable."""
        reasons = self._reasons
        if reasons is None:
            with self._lock:
                if self._reasons is None:
                    self._reasons = list(self._probe())
                reasons = self._reasons
        return list(reasons)

    def reset(self) -> None:
        with self._lock:
            self._reasons = None

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"
