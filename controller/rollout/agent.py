"""The router agent: the library a Python router embeds to run the controller's policy.

One :class:`RouterAgent` per router process. It

* holds the running policy as one immutable :class:`PolicySnapshot` behind a single
  attribute, so an update is one reference swap and ``decide()`` — which reads that attribute
  once — is safe from any number of threads or tasks while an update lands;
* validates every update and keeps the last good policy when it refuses one, saying why
  (:class:`ApplyOutcome`); persists an applied policy to ``state_file`` (atomic write: temp
  file, fsync, rename, fsync of the directory) *before* switching to it, and loads it on start;
* decides in a few microseconds: the snapshot pre-resolves every table cell into ready-made
  :class:`Decision` objects and counter ticks, so the hot path is three bisections, one dict
  lookup and one lock-free tick. ``decide()`` gives the same answers as
  :func:`controller.policy.decide` (a property test holds it to that);
* fills ``Features.prefill_waiting`` (turn 1's busy override) from an injected source when a
  router leaves it out (:class:`controller.rollout.prefill_watch.PrefillQueueWatch`);
* judges completed requests against the running policy's SLOs (``observe``) and exports the
  ``pdrouter_*`` metrics (see :mod:`controller.rollout.agent_metrics`).

Start-up: a readable, valid ``state_file`` wins over ``initial_policy`` (the state file holds
what the controller last pushed; ``initial_policy`` — e.g. the ``[ppd].lookup_table`` file — is
only the fallback). A corrupt state file is renamed to ``<name>.corrupt-<n>`` and logged.

Staleness: the policy's age counts from when this process applied or loaded it (a restart
loads the state file and starts the clock again); with no policy at all the agent is not
"stale" but every decision is counted with reason ``no_policy``.
"""

from __future__ import annotations

import contextlib
import enum
import glob
import logging
import os
import random
import tempfile
import threading
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from controller.clock import Clock, WallClock
from controller.policy import (
    Decision,
    Features,
    Policy,
    PolicyValidationError,
    Problem,
    Reason,
    Route,
    Slo,
    dumps,
    first_turn_busy_waiting,
    later_turn_busy_waiting,
    loads,
    validate_policy,
)
from controller.policy.bins import CONTEXT_BINS, IO_RATIO_BINS, UNKNOWN_BIN
from controller.rollout.agent_metrics import RouterMetrics, slo_label

_INF = float("inf")
# Cells are resolved into Decision objects on first use, not when a policy is applied:
# resolving all 1000 cells up front costs ~10 ms of CPU per apply, which would dominate a
# push to hundreds of routers; the first request of a cell pays a few microseconds once.
# An unexpected exception inside decide() is logged at most this often.
_ERROR_LOG_INTERVAL_S = 60.0

_DEFAULT_SLO = Slo()


class ApplyOutcome(enum.StrEnum):
    APPLIED = "applied"
    NOOP = "noop"  # same version, same checksum: already running it
    CONFLICT = "conflict"  # same version, other checksum: refused
    STALE = "stale"  # lower version without rollback: refused
    INVALID = "invalid"  # failed validation: refused
    PERSIST_FAILED = "persist_failed"  # could not be written to the state file: not applied


@dataclass(frozen=True, slots=True)
class ApplyResult:
    outcome: ApplyOutcome
    applied_version: int  # the version the agent runs after the call, 0 if none
    checksum: str  # its checksum, "" if none
    message: str


# One decision together with the tick of its (route, reason) counter.
_Entry = tuple[Decision, Callable[[], int]]
# Per table cell: the table's decision, the explored one and the exploration fraction.
# (the cell's route, its explored route, exploration fraction, the later-turn busy override's
# decode-local entry: None when the override is off or the cell already runs decode-local)
_CellEntry = tuple[_Entry, _Entry, float, _Entry | None]


class PolicySnapshot:
    """Everything ``decide()`` needs from one policy, resolved once and never mutated.

    ``lookup`` bundles the hot fields in one tuple so ``decide()`` unpacks them in one step.
    """

    __slots__ = (
        "_cells",
        "_tallies",
        "applied_at",
        "busy_first_turn",
        "busy_waiting",
        "bypass",
        "bypass_below",
        "checksum",
        "first_turn",
        "invalid",
        "later_busy_waiting",
        "lookup",
        "policy",
        "slo",
        "timeout",
        "version",
    )

    def __init__(
        self,
        policy: Policy,
        checksum: str,
        applied_at: float,
        tallies: Callable[[Route, Reason], Callable[[], int]],
    ) -> None:
        self.policy = policy
        self.checksum = checksum
        self.applied_at = applied_at
        self.version = policy.version
        self.slo = policy.slo
        self._tallies = tallies
        default = policy.default_route
        self.invalid = self._entry(Decision(default, None, Reason.INVALID_INPUT))
        self.timeout = self._entry(Decision(default, None, Reason.TIMEOUT))
        self.first_turn = self._entry(
            Decision(policy.overrides.first_turn_route, None, Reason.FIRST_TURN)
        )
        self.bypass = self._entry(Decision(Route.DECODE_LOCAL, None, Reason.BYPASS))
        self.busy_first_turn = self._entry(
            Decision(Route.DECODE_LOCAL, None, Reason.BUSY_PREFILL)
        )
        # 0 unless turn 1 goes to a prefill node and the busy override is on: one test decides.
        self.busy_waiting = first_turn_busy_waiting(policy)
        self.later_busy_waiting = later_turn_busy_waiting(policy)
        self.bypass_below = policy.overrides.bypass_append_tokens
        axes = policy.table.axes
        n_ctx, n_io, n_qps = axes.shape
        # A list (not a dict) because indexing it is the cheapest lookup; None = not resolved.
        self._cells: list[_CellEntry | None] = [None] * axes.n_cells
        # Edges as floats: bisecting floats against floats is ~1.5x faster than against ints.
        self.lookup = (
            _floats(axes.context_tokens), n_ctx - 1,
            _floats(axes.io_ratio), n_io - 1,
            _floats(axes.qps), n_qps - 1,
            n_io, n_qps,
            self._cells, self.cell_entry,
        )

    def _entry(self, decision: Decision) -> _Entry:
        return (decision, self._tallies(decision.route, decision.reason))

    def cell_entry(self, index: int) -> _CellEntry:
        """Resolve (and cache) one cell. Racing threads may both build it; either copy is right."""
        table = self.policy.table
        route = table.routes[index]
        coords = table.axes.cell_coords(index)
        busy = (self._entry(Decision(Route.DECODE_LOCAL, coords, Reason.BUSY_LATER_TURN))
                if self.later_busy_waiting and route is Route.PREFILL_NODE else None)
        entry = (
            self._entry(Decision(route, coords, Reason.TABLE)),
            self._entry(Decision(route.other, coords, Reason.EXPLORE, explored=True)),
            table.exploration[index],
            busy,
        )
        self._cells[index] = entry
        return entry


def _floats(edges: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(float(e) for e in edges)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file.

    Writes a temporary file in the same directory, flushes and fsyncs it, renames it over
    ``path`` and fsyncs the directory so the rename itself is durable. On any error the
    temporary file is removed and ``path`` is untouched; the error propagates.
    """
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class RouterAgent:
    """Runs the controller's policy inside a router. See the module docstring.

    ``writer`` is the persistence seam (default :func:`atomic_write_bytes`): tests pass one
    that fails like a full disk.
    """

    def __init__(
        self,
        *,
        router_id: str = "",
        clock: Clock | None = None,
        registry: CollectorRegistry | None = None,
        state_file: Path | None = None,
        decision_timeout_ms: float = 1.0,
        stale_after_s: float = 900.0,
        draw: Callable[[], float] | None = None,
        initial_policy: Policy | None = None,
        logger: logging.Logger | None = None,
        writer: Callable[[Path, bytes], None] | None = None,
        prefill_waiting: Callable[[], float | None] | None = None,
    ) -> None:
        if not decision_timeout_ms > 0:
            raise ValueError(f"decision_timeout_ms must be > 0, got {decision_timeout_ms!r}")
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self.router_id = router_id
        self._clock: Clock = clock if clock is not None else WallClock()
        self._registry = registry if registry is not None else CollectorRegistry()
        self._state_file = Path(state_file) if state_file is not None else None
        self._timeout_ns = int(decision_timeout_ms * 1_000_000)
        self._stale_after_s = float(stale_after_s)
        self._draw: Callable[[], float] = draw if draw is not None else random.Random().random
        self._log = logger if logger is not None else logging.getLogger(__name__)
        self._writer = writer if writer is not None else atomic_write_bytes
        self._perf = self._clock.perf_counter_ns
        self._apply_lock = threading.Lock()
        self._last_error_log: float | None = None
        self._stale_logged = False
        self._last_qps = 0.0
        # Fills ``Features.prefill_waiting`` when a router leaves it out (PrefillQueueWatch).
        self._prefill_waiting = prefill_waiting

        self.metrics = RouterMetrics(self._registry)
        self._tallies = self.metrics.decision_tallies
        self._no_policy: _Entry = self._tally_entry(
            Decision(Route.PREFILL_NODE, None, Reason.NO_POLICY)
        )
        self.metrics.policy_age.set_function(self._age_metric)
        self.metrics.policy_stale.set_function(lambda: 1.0 if self.is_stale() else 0.0)
        self.metrics.qps.set_function(lambda: self._last_qps)

        # The one reference decide() reads; replaced whole by _install().
        self._snapshot: PolicySnapshot | None = None
        start = self._load_state_file()
        if start is None and initial_policy is not None:
            problems = validate_policy(initial_policy)
            if problems:
                self._log.error(
                    "router %s: initial policy refused, starting without a policy: %s",
                    self.router_id, "; ".join(map(str, problems)),
                )
            else:
                start = initial_policy
        if start is not None:
            self._install(start, start.checksum)

    # -- what runs now ------------------------------------------------------------------

    @property
    def snapshot(self) -> PolicySnapshot | None:
        """The running policy, its checksum and when it was applied, read consistently."""
        return self._snapshot

    @property
    def policy(self) -> Policy | None:
        snap = self._snapshot
        return snap.policy if snap is not None else None

    @property
    def checksum(self) -> str:
        snap = self._snapshot
        return snap.checksum if snap is not None else ""

    @property
    def applied_at(self) -> float | None:
        snap = self._snapshot
        return snap.applied_at if snap is not None else None

    @property
    def registry(self) -> CollectorRegistry:
        return self._registry

    # -- updates ------------------------------------------------------------------------

    def apply(self, policy: Policy, *, rollback: bool = False) -> ApplyResult:
        """Validate, persist, then switch to ``policy``; refuse with a reason otherwise."""
        with self._apply_lock:
            result = self._apply_locked(policy, rollback)
        self.metrics.updates.labels(result.outcome.value).inc()
        if result.outcome in (ApplyOutcome.APPLIED, ApplyOutcome.NOOP):
            self._log.info("router %s: %s", self.router_id, result.message)
        else:
            self._log.warning("router %s: update refused: %s", self.router_id, result.message)
        return result

    def _apply_locked(self, policy: Policy, rollback: bool) -> ApplyResult:
        current = self._snapshot
        cur_version = current.version if current is not None else 0
        cur_checksum = current.checksum if current is not None else ""

        def result(outcome: ApplyOutcome, message: str) -> ApplyResult:
            snap = self._snapshot
            return ApplyResult(
                outcome,
                snap.version if snap is not None else 0,
                snap.checksum if snap is not None else "",
                message,
            )

        try:
            problems = validate_policy(policy)
        except Exception as e:  # not even shaped like a Policy (a bug in the caller's decoding)
            problems = [Problem("$", f"cannot be validated: {type(e).__name__}: {e}")]
        if problems:
            listed = "; ".join(str(p) for p in problems)
            return result(
                ApplyOutcome.INVALID,
                f"policy v{getattr(policy, 'version', '?')!r} is invalid "
                f"({len(problems)} problem(s)): {listed}; keeping v{cur_version}",
            )
        checksum = policy.checksum
        if current is not None and policy.version == cur_version:
            if checksum == cur_checksum:
                return result(ApplyOutcome.NOOP, f"v{cur_version} ({checksum[:12]}) already runs")
            return result(
                ApplyOutcome.CONFLICT,
                f"v{policy.version} arrived with checksum {checksum[:12]} but v{cur_version} "
                f"runs with {cur_checksum[:12]}: one version cannot name two policies",
            )
        if current is not None and policy.version < cur_version and not rollback:
            return result(
                ApplyOutcome.STALE,
                f"v{policy.version} is older than the running v{cur_version} "
                "(send it as a rollback to go back)",
            )
        if self._state_file is not None:
            try:
                self._writer(self._state_file, dumps(policy, indent=None).encode())
            except OSError as e:
                return result(
                    ApplyOutcome.PERSIST_FAILED,
                    f"v{policy.version} not applied: cannot persist it to {self._state_file}: "
                    f"{e}; keeping v{cur_version}",
                )
        self._install(policy, checksum)
        kind = "rolled back to" if policy.version < cur_version else "applied"
        return result(
            ApplyOutcome.APPLIED, f"{kind} v{policy.version} ({checksum[:12]}), was v{cur_version}"
        )

    def _install(self, policy: Policy, checksum: str) -> None:
        snapshot = PolicySnapshot(policy, checksum, self._clock.now(), self._tally_tick)
        self._snapshot = snapshot  # the atomic swap: one reference assignment
        self._stale_logged = False
        self.metrics.policy_version.set(policy.version)

    def _load_state_file(self) -> Policy | None:
        path = self._state_file
        if path is None:
            return None
        self._remove_leftover_temps(path)
        if not path.exists():
            return None
        if not path.is_file():
            # A device or a pipe: never renamed as "corrupt" (/dev/null, as root), never
            # read (a FIFO blocked the start for good).
            self._log.error("router %s: state file %s is not a regular file; starting from "
                            "the initial policy", self.router_id, path)
            return None
        try:
            data = path.read_bytes()
        except OSError as e:
            self._log.error(
                "router %s: cannot read state file %s (%s); starting from the initial policy",
                self.router_id, path, e,
            )
            return None
        try:
            policy = loads(data)
        except (PolicyValidationError, UnicodeDecodeError) as e:
            kept = self._set_aside(path)
            self._log.error(
                "router %s: state file %s is corrupt, moved to %s; starting from the initial "
                "policy. %s",
                self.router_id, path, kept, e,
            )
            return None
        self._log.info(
            "router %s: loaded v%d (%s) from %s",
            self.router_id, policy.version, policy.checksum[:12], path,
        )
        return policy

    def _remove_leftover_temps(self, path: Path) -> None:
        """Temporary files of writes a kill cut short (``atomic_write_bytes``): never the
        state, up to a table's size each, and nothing else removes them."""
        for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            try:
                tmp.unlink()
            except OSError as e:
                self._log.warning("router %s: cannot remove %s: %s", self.router_id, tmp, e)
            else:
                self._log.info("router %s: removed %s, left by an interrupted write",
                               self.router_id, tmp)

    def _set_aside(self, path: Path) -> Path | None:
        """Rename a corrupt state file to ``<name>.corrupt-<n>`` (kept for a post-mortem)."""
        n = 1
        while (target := path.with_name(f"{path.name}.corrupt-{n}")).exists():
            n += 1
        try:
            path.rename(target)
        except OSError as e:
            self._log.error("router %s: cannot rename %s: %s", self.router_id, path, e)
            return None
        return target

    # -- decisions ------------------------------------------------------------------------

    def _tally_tick(self, route: Route, reason: Reason) -> Callable[[], int]:
        return self._tallies[(route, reason)].tick

    def _tally_entry(self, decision: Decision) -> _Entry:
        return (decision, self._tally_tick(decision.route, decision.reason))

    def decide(self, features: Features) -> Decision:
        """Route one request. Never raises; same answers as :func:`controller.policy.decide`.
        Flat (no helper calls on the table path): it runs for every request and its budget
        is a few microseconds including the metric update."""
        snap = self._snapshot
        if snap is None:
            decision, tick = self._no_policy
            tick()
            return decision
        perf = self._perf
        started = perf()
        try:
            turn = features.turn
            ctx = features.context_tokens
            append = features.append_tokens
            out = features.expected_output_tokens
            qps = features.qps
            # Chained comparisons are False for NaN, so this is "finite and in range".
            if not (1 <= turn < _INF and 0.0 <= ctx < _INF and 0.0 <= append < _INF
                    and 0.0 < out < _INF and 0.0 <= qps < _INF):
                entry = snap.invalid
            else:
                self._last_qps = qps
                if turn == 1:
                    entry = snap.first_turn
                    if snap.busy_waiting and self._busy(snap.busy_waiting, features):
                        entry = snap.busy_first_turn
                elif append < snap.bypass_below:
                    entry = snap.bypass
                else:
                    (ctx_edges, ctx_last, io_edges, io_last, qps_edges, qps_last,
                     n_io, n_qps, cells, resolve) = snap.lookup
                    i = bisect_left(ctx_edges, ctx)
                    if i > ctx_last:
                        i = ctx_last
                    j = bisect_left(io_edges, append / out)
                    if j > io_last:
                        j = io_last
                    k = bisect_left(qps_edges, qps)
                    if k > qps_last:
                        k = qps_last
                    index = (i * n_io + j) * n_qps + k
                    cell = cells[index] or resolve(index)
                    explore_fraction = cell[2]
                    if explore_fraction > 0.0 and self._draw() < explore_fraction:
                        entry = cell[1]
                    else:
                        entry = cell[0]
                        busy = cell[3]
                        if busy is not None and self._busy(snap.later_busy_waiting, features):
                            entry = busy
        except Exception:
            entry = snap.invalid
            self._log_decide_error()
        if perf() - started > self._timeout_ns:
            entry = snap.timeout
        decision, tick = entry
        tick()
        return decision

    def _busy(self, need: int, features: Features) -> bool:
        """Whether the least-busy prefill worker has at least ``need`` waiting: the request's
        own count, else the agent's prefill watch's (unknown: not busy)."""
        waiting = features.prefill_waiting
        if waiting is None and self._prefill_waiting is not None:
            waiting = self._prefill_waiting()
        # The chained comparison is False for NaN; another type is unknown.
        return isinstance(waiting, (int, float)) and need <= waiting < _INF

    def _log_decide_error(self) -> None:
        now = self._clock.monotonic()
        last = self._last_error_log
        if last is None or now - last >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            self._log.exception(
                "router %s: decide() failed, using the default route (logged at most once a "
                "minute)", self.router_id,
            )

    # -- outcomes -------------------------------------------------------------------------

    def observe(
        self,
        decision: Decision,
        ttft_s: float,
        tpot_s: float | None,
        features: Features | None = None,
    ) -> str:
        """Count one completed request; return its SLO label (met|ttft_miss|tpot_miss|both_miss).

        ``tpot_s`` is None for a request with one output token (it has no TPOT and meets it).
        The SLOs are the running policy's (the defaults when there is none).
        """
        snap = self._snapshot
        slo = snap.slo if snap is not None else _DEFAULT_SLO
        label = slo_label(*slo.met(ttft_s, tpot_s))
        route = decision.route.name
        ctx_bin = io_bin = UNKNOWN_BIN
        if features is not None:
            ctx_bin, io_bin = _feature_bins(features)
            if ctx_bin != UNKNOWN_BIN:
                self.metrics.context_tokens.observe(features.context_tokens)
            if io_bin != UNKNOWN_BIN:
                self.metrics.io_ratio.observe(features.io_ratio)
        m = self.metrics
        m.count_request(route, ctx_bin, io_bin, label)
        if 0.0 <= ttft_s < _INF:
            m.observe_ttft(route, ctx_bin, ttft_s)
        if tpot_s is not None and 0.0 <= tpot_s < _INF:
            m.observe_tpot(route, ctx_bin, tpot_s)
        self.is_stale()  # notices (and logs) the moment the policy goes stale
        return label

    # -- staleness ------------------------------------------------------------------------

    def policy_age_s(self) -> float | None:
        snap = self._snapshot
        if snap is None:
            return None
        return max(0.0, self._clock.now() - snap.applied_at)

    def is_stale(self) -> bool:
        """True when no update came for longer than ``stale_after_s``; logs once when it turns."""
        age = self.policy_age_s()
        stale = age is not None and age > self._stale_after_s
        if stale and not self._stale_logged:
            self._stale_logged = True
            self._log.warning(
                "router %s: policy v%s is stale: no update for %.0f s (limit %.0f s)",
                self.router_id, self._snapshot.version if self._snapshot else "?", age,
                self._stale_after_s,
            )
        return stale

    def _age_metric(self) -> float:
        age = self.policy_age_s()
        return -1.0 if age is None else age


def _feature_bins(features: Features) -> tuple[str, str]:
    """Fixed-edge bin labels of a request's context length and io ratio ("unknown" if bad)."""
    try:
        ctx_bin = CONTEXT_BINS.label(features.context_tokens)
        out = features.expected_output_tokens
        if 0.0 < out < _INF:
            io_bin = IO_RATIO_BINS.label(features.append_tokens / out)
        else:
            io_bin = UNKNOWN_BIN
    except (TypeError, ArithmeticError):
        return UNKNOWN_BIN, UNKNOWN_BIN
    return ctx_bin, io_bin
