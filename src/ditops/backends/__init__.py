"""Optional outside libraries, probed lazily: one module per library.

A :class:`Backend` answers :meth:`Backend.probe` with the reasons it cannot be used
(empty when usable). Probing imports the library, once, on first use: never at
``import ditops``.
"""

from __future__ import annotations

from ditops.backends.base import Backend

__all__ = ["Backend"]
