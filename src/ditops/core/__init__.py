"""The op machinery: how an op declares its call and its paths, and how one is chosen.

From the ground up:

* :mod:`ditops.core.checks`, :mod:`ditops.core.calls`: the shared argument validators and
  the call records ``prepare`` makes.
* :mod:`ditops.core.paths`: :func:`path` (a fast path's declaration), and the reports
  :class:`PathReport` / :class:`Decision` that explanations are made of.
* :mod:`ditops.core.declared`: what the dispatcher reads of an op's declaration.
* :mod:`ditops.core.registry`: the registered ops and what dispatch learned in this process.
* :mod:`ditops.core.plan`: which paths may run a call (the cached plan, the per-call checks).
* :mod:`ditops.core.fallback`: running a path; the meaning when it raises.
* :mod:`ditops.core.traced`, :mod:`ditops.core.tune`: the choice inside ``torch.compile``,
  and by measurement (``DITOPS_TUNE``).
* :mod:`ditops.core.dispatch`: :func:`~ditops.core.dispatch.run` and
  :func:`~ditops.core.dispatch.explain`, the one entry the op calls.
* :mod:`ditops.core.op`: :class:`CustomOp`, the declaration (meaning, paths, ``prepare``).
* :mod:`ditops.core.explain`: :func:`explain` and the table ``ditops info`` prints.
"""
