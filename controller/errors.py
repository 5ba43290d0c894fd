"""Error taxonomy: retry what may pass, stop on what will not.

A :class:`TransientError` (a router not answering, Prometheus slow, the database
restarting) is retried with backoff and the cycle is skipped with a recorded reason. A
:class:`TerminalError` (invalid config, a corrupt policy, a refused version) is not
retried: the same input would fail the same way.
"""

from __future__ import annotations


class ControllerError(Exception):
    """Base of every error pd-controller raises on purpose."""


class TransientError(ControllerError):
    """May succeed if tried again later."""


class TerminalError(ControllerError):
    """Will fail again with the same input; do not retry."""


class ConfigError(TerminalError):
    """The configuration is invalid; the message names every bad key."""


class PolicyError(TerminalError):
    """A policy is malformed or inconsistent (see ``problems`` on the validation error)."""
