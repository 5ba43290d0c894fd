"""Azure LLM inference trace 2023 (conversation and coding services; CC-BY 4.0, Splitwise).

Each CSV row is one request (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``). The trace
has no sessions; rows are grouped into multi-turn sessions of the shape fitted to Mooncake
(:mod:`controller.sim.workloads.fit`); ``sessions = "none"`` keeps one-turn sessions instead.
Arrival times are seconds from the first row. ``max_tokens``: as for Mooncake (``"pow2"``
default, ``"cap"`` = the file's largest output: 1,000 for conv, 1,899 for code, or an int).
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Iterator, Mapping
from datetime import date
from pathlib import Path
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

TRACE_FILES = {
    "azure-conv": "azure_llm_2023_conv.csv.gz",
    "azure-code": "azure_llm_2023_code.csv.gz",
}
PARAMS = {"path", "max_sessions", "max_tokens", "sessions", "shape", "max_prompt_tokens"}


def _seconds(stamp: str) -> float:
    day, clock = stamp.strip().split(" ")
    hours, minutes, seconds = clock.split(":")
    return (
        date.fromisoformat(day).toordinal() * 86_400.0
        + int(hours) * 3600
        + int(minutes) * 60
        + float(seconds)
    )


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int) -> tuple[SourceRequest, ...]:
    del mtime_ns, size  # cache key only
    rows: list[tuple[float, int, int]] = []
    with reading(path, "Azure trace"), open_text(path) as fh:
        reader = csv.DictReader(fh)
        for number, row in enumerate(reader, start=2):
            try:
                rows.append(
                    (
                        _seconds(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except (KeyError, ValueError, AttributeError) as exc:
                raise WorkloadError(
                    f"{path}:{number}: expected TIMESTAMP,ContextTokens,GeneratedTokens: {exc!r}"
                ) from exc
            if rows[-1][1] < 1 or rows[-1][2] < 1:
                raise WorkloadError(f"{path}:{number}: token counts must be >= 1")
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    origin = rows[0][0]
    return tuple(SourceRequest(t - origin, i, o) for t, i, o in rows)


def load_requests(path: Path) -> tuple[SourceRequest, ...]:
    require_file(path, "azure trace")
    stat = path.stat()
    return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


class AzureWorkload:
    def __init__(
        self,
        name: str,
        path: Path,
        *,
        shape: SessionShape | None,
        max_sessions: int | None = None,
        max_tokens: MaxTokensRule = "pow2",
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    ) -> None:
        self.name = name
        self.requests = load_requests(path)
        self.shape = shape
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.max_prompt_tokens = max_prompt_tokens

    @classmethod
    def from_params(
        cls, source: str, params: Mapping[str, Any], traces_dir: Path = TRACES_DIR
    ) -> AzureWorkload:
        p = Params(source, params, PARAMS)
        grouping = p.string("sessions", "fitted", ("fitted", "none"))
        shape = None if grouping == "none" else load_shape(p.optional_path("shape"))
        return cls(
            source,
            p.path("path", traces_dir / TRACE_FILES[source]),
            shape=shape,
            max_sessions=p.optional_integer("max_sessions"),
            max_tokens=p.max_tokens_rule(),
            max_prompt_tokens=p.integer("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS, minimum=2),
        )

    def sessions(self, rng: random.Random) -> Iterator[SessionSpec]:
        built = synthesize_sessions(
            self.requests,
            self.shape,
            rng,
            prefix=self.name,
            max_tokens=self.max_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
        )
        yield from built[: self.max_sessions] if self.max_sessions is not None else built
