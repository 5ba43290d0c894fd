"""``pdctl router serve``: a P/D router on vLLM's HTTP protocol that runs the learned policy.

See ``docs/router.md``. The package is an adapter: it embeds the rollout package's
:class:`~controller.rollout.agent.RouterAgent` and :class:`~controller.rollout.server.RouterServer`
and keeps its HTTP work in :mod:`controller.router.proxy`; the request-shaping rules of the
P/D protocol are plain functions in :mod:`controller.router.protocol`.
"""
