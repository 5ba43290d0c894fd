"""ServeGen (Alibaba Bailian, Apache-2.0): rate and length-mix shifts over days.

Sources, bundled in ``controller/data/traces`` (``params.dataset`` picks one; ``params.path``
reads a user's own file of the same columns instead):

- ``m-large`` (default): ``servegen_m-large_aggregate_derived.csv``, 14 days of a language
  model's 162 clients;
- ``deepseek-r1``: ``servegen_deepseek-r1_aggregate_derived.csv``, one day of the reasoning
  model's 73 clients, with the reasoning share of the output (``reason_ratio_*`` columns, not
  used by the generator: the output lengths already include the reasoning tokens).

Both are derived from the upstream tarballs by ``scripts/derive_servegen_aggregate.py`` (see
``controller/data/README.md``): per 600 s window the aggregate rate of all clients and the
input/output p50/p90/p99 of the 6 h length window that contains it. The per-client tarballs
add per-client burstiness fits; their sum over the clients is close to Poisson, so the
aggregate file is enough here.

Generation, for a trace-time window ``[a, b)`` (``time_slice_s``, default
``[0, duration_s * time_scale)``):

- arrivals: a Poisson process whose rate follows the 600 s windows, rescaled as ServeGen's own
  generator does (rates relative to a target): the mean request rate over the window is
  ``mean_rate_rps`` in simulated seconds; ``time_scale`` trace seconds pass per simulated
  second (24 replays a day's shifts in an hour);
- lengths: drawn per request from the length window it falls in, by a quantile function
  through p50/p90/p99 that is log-normal in pieces (``ln q`` linear in the normal score
  between the anchors, the p50-p90 slope below the median, clamped at the 0.1 %/99.9 %
  scores), so each window's three percentiles are reproduced;
- sessions: grouped with the Mooncake-fitted shape, as for Azure (``sessions = "none"`` keeps
  single turns). ``max_tokens``: ``"pow2"`` (default), ``"cap"`` or an integer.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from controller.data import TRACES_DIR
from controller.sim.workloads.base import (
    MaxTokensRule,
    Params,
    SessionSpec,
    WorkloadError,
    open_text,
    reading,
    require_file,
)
from controller.sim.workloads.fit import (
    DEFAULT_MAX_PROMPT_TOKENS,
    SessionShape,
    SourceRequest,
    load_shape,
    synthesize_sessions,
)

if TYPE_CHECKING:
    import random

DATASETS = {
    "m-large": "servegen_m-large_aggregate_derived.csv",
    "deepseek-r1": "servegen_deepseek-r1_aggregate_derived.csv",
}
TRACE_FILE = DATASETS["m-large"]
WINDOW_S = 600.0
PARAMS = {
    "path",
    "dataset",
    "mean_rate_rps",
    "time_scale",
    "duration_s",
    "max_sessions",
    "max_tokens",
    "sessions",
    "shape",
    "max_prompt_tokens",
    "max_output_tokens",
}
_NORMAL = NormalDist()
Z90 = _NORMAL.inv_cdf(0.90)
Z99 = _NORMAL.inv_cdf(0.99)
Z_CLAMP = _NORMAL.inv_cdf(0.999)


@dataclass(frozen=True, slots=True)
class LengthQuantiles:
    p50: float
    p90: float
    p99: float

    def at(self, u: float) -> float:
        """The ``u``-quantile of the piecewise log-normal through the three anchors."""
        z = max(-Z_CLAMP, min(Z_CLAMP, _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))))
        low, mid, high = math.log(self.p50), math.log(self.p90), math.log(self.p99)
        if z <= Z90:
            return math.exp(low + z * (mid - low) / Z90)
        return math.exp(mid + (z - Z90) * (high - mid) / (Z99 - Z90))


@dataclass(frozen=True, slots=True)
class RateWindow:
    start_s: float
    rate_rps: float
    input: LengthQuantiles
    output: LengthQuantiles


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, mtime_ns: int, size: int) -> tuple[RateWindow, ...]:
    del mtime_ns, size  # cache key only
    windows = []
    with reading(path, "ServeGen trace"), open_text(path) as fh:
        for number, row in enumerate(csv.DictReader(fh), start=2):
            try:
                window = RateWindow(
                    start_s=float(row["window_start_s"]),
                    rate_rps=float(row["total_rate_rps"]),
                    input=LengthQuantiles(
                        float(row["input_p50"]), float(row["input_p90"]), float(row["input_p99"])
                    ),
                    output=LengthQuantiles(
                        float(row["output_p50"]),
                        float(row["output_p90"]),
                        float(row["output_p99"]),
                    ),
                )
            except (KeyError, ValueError, TypeError) as exc:
                raise WorkloadError(f"{path}:{number}: malformed ServeGen row: {exc!r}") from exc
            q = (window.input, window.output)
            if window.rate_rps < 0 or any(not 0 < x.p50 <= x.p90 <= x.p99 for x in q):
                raise WorkloadError(f"{path}:{number}: need rate >= 0 and 0 < p50 <= p90 <= p99")
            windows.append(window)
    if not windows:
        raise WorkloadError(f"{path}: no rate windows")
    return tuple(sorted(windows, key=lambda w: w.start_s))


def load_windows(path: Path) -> tuple[RateWindow, ...]:
    require_file(path, "servegen aggregate csv")
    stat = path.stat()
    return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


class ServeGenWorkload:
    name = "servegen"

    def __init__(
        self,
        path: Path,
        *,
        trace_window_s: tuple[float, float] | None = None,
        duration_s: float = 3600.0,
        mean_rate_rps: float = 5.0,
        time_scale: float = 1.0,
        shape: SessionShape | None,
        max_sessions: int | None = None,
        max_tokens: MaxTokensRule = "pow2",
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        max_output_tokens: int = 32_768,
    ) -> None:
        self.windows = load_windows(path)
        trace_end = self.windows[-1].start_s + WINDOW_S
        a, b = trace_window_s or (0.0, duration_s * time_scale)
        if a >= trace_end:
            raise WorkloadError(
                f"workload.time_slice_s: starts at {a} s, after the trace's end ({trace_end} s)"
            )
        self.trace_window_s = (a, min(b, trace_end))
        self.mean_rate_rps = mean_rate_rps
        self.time_scale = time_scale
        self.shape = shape
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.max_output_tokens = max_output_tokens

    @classmethod
    def from_params(
        cls,
        params: Mapping[str, Any],
        traces_dir: Path = TRACES_DIR,
        trace_window_s: tuple[float, float] | None = None,
    ) -> ServeGenWorkload:
        p = Params("servegen", params, PARAMS)
        grouping = p.string("sessions", "fitted", ("fitted", "none"))
        return cls(
            p.path("path", traces_dir / DATASETS[p.string("dataset", "m-large", tuple(DATASETS))]),
            trace_window_s=trace_window_s,
            duration_s=p.number("duration_s", 3600.0, strict=True),
            mean_rate_rps=p.number("mean_rate_rps", 5.0, strict=True),
            time_scale=p.number("time_scale", 1.0, strict=True),
            shape=None if grouping == "none" else load_shape(p.optional_path("shape")),
            max_sessions=p.optional_integer("max_sessions"),
            max_tokens=p.max_tokens_rule(),
            max_prompt_tokens=p.integer("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS, minimum=2),
            max_output_tokens=p.integer("max_output_tokens", 32_768, minimum=1),
        )

    def _pieces(self) -> list[tuple[float, float, RateWindow]]:
        """(trace start, trace end, window) of every window part inside the trace window."""
        a, b = self.trace_window_s
        pieces = []
        for w in self.windows:
            lo, hi = max(a, w.start_s), min(b, w.start_s + WINDOW_S)
            if hi > lo:
                pieces.append((lo, hi, w))
        return pieces

    def requests(self, rng: random.Random) -> list[SourceRequest]:
        """Arrivals (simulated seconds from 0) and lengths, before sessions are formed."""
        a, b = self.trace_window_s
        pieces = self._pieces()
        mean_rate = sum((hi - lo) * w.rate_rps for lo, hi, w in pieces) / (b - a)
        if mean_rate <= 0:
            return []
        out: list[SourceRequest] = []
        for lo, hi, w in pieces:
            rate = self.mean_rate_rps * w.rate_rps / mean_rate  # per simulated second
            start, end = (lo - a) / self.time_scale, (hi - a) / self.time_scale
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                prompt = _tokens(w.input.at(rng.random()), self.max_prompt_tokens)
                output = _tokens(w.output.at(rng.random()), self.max_output_tokens)
                out.append(SourceRequest(t, prompt, output))
        return out

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        built = synthesize_sessions(
            self.requests(rng),
            self.shape,
            rng,
            prefix=self.name,
            max_tokens=self.max_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
        )
        yield from built[: self.max_sessions] if self.max_sessions is not None else built


def _tokens(value: float, cap: int) -> int:
    return max(1, min(cap, round(value)))


def window_percentiles(values: Sequence[int]) -> tuple[float, float, float]:
    """p50/p90/p99 of ``values`` (nearest rank), to compare generated lengths with the file."""
    ordered = sorted(values)

    def rank(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return rank(0.5), rank(0.9), rank(0.99)
