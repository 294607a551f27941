"""The op machinery: how an op declares its call and its paths, and how one is chosen.

* :mod:`ditops.core.checks`: the shared argument validators and dtype names.
* :mod:`ditops.core.paths`: :func:`path` (a fast path's declaration), and the reports
  :class:`PathReport` / :class:`Decision` that explanations are made of.
* :mod:`ditops.core.op`: :class:`CustomOp` (prepare, dispatch, fallback, the non-finite
  rule), the registry and the process state.
* :mod:`ditops.core.explain`: :func:`explain` and the table ``ditops info`` prints.
"""
