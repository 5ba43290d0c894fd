"""``render_latest(registry)``: the bytes of ``prometheus_client.generate_latest(registry)``
(text format 0.0.4, default name escaping), computed with the label part of each sample line
memoized.

An in-process source renders every simulated target once per control window, and most of
``generate_latest``'s time goes to escaping and sorting the same label sets again; the label
sets of a registry repeat from one render to the next while their values change. The output
is byte-for-byte that of ``generate_latest`` of the pinned ``prometheus-client`` (checked
against it in ``tests/observe/test_render.py``): same family munging, same HELP escaping,
same ``floatToGoString`` values, same placement of ``_created``/``_gsum``/``_gcount`` samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_go_float: Callable[[float], str] = floatToGoString  # the value text generate_latest writes

_ESCAPING = openmetrics.UNDERSCORES
_TYPES = {"counter": "counter", "info": "gauge", "stateset": "gauge",
          "gaugehistogram": "histogram", "unknown": "untyped"}
_SUFFIX = {"counter": "_total", "info": "_info"}
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
_CACHE_LIMIT = 100_000
# (sample name, its labels in the sample's order) -> "name{sorted, escaped labels} "
_PREFIXES: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}


def _label(k: str, v: str) -> str:
    name = openmetrics.escape_label_name(k, _ESCAPING)
    # label values are escaped as generate_latest escapes them (always UTF-8 allowed)
    value = v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return f'{name}="{value}"'


def _prefix(name: str, labels: dict[str, str]) -> str:
    key = (name, tuple(labels.items()))
    got = _PREFIXES.get(key)
    if got is None:
        if len(_PREFIXES) >= _CACHE_LIMIT:
            _PREFIXES.clear()
        got = openmetrics.escape_metric_name(name, _ESCAPING)
        if labels:
            body = ",".join(_label(k, v) for k, v in sorted(labels.items()))
            got = f"{got}{{{body}}}"
        got = _PREFIXES[key] = got + " "
    return got


def _sample_line(s: Any) -> str:
    timestamp = ""
    if s.timestamp is not None:
        timestamp = f" {int(float(s.timestamp) * 1000):d}"
    return f"{_prefix(s.name, s.labels)}{_go_float(s.value)}{timestamp}\n"


def _header(name: str, documentation: str, mtype: str) -> str:
    escaped = openmetrics.escape_metric_name(name, _ESCAPING)
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {escaped} {doc}\n# TYPE {escaped} {mtype}\n"


def render_latest(registry: Collector) -> bytes:
    """``generate_latest(registry)``'s bytes; a collector's exception propagates with the
    metric appended to its args, as there."""
    output: list[str] = []
    for metric in registry.collect():
        om_samples: dict[str, list[str]] = {}
        try:
            mtype = metric.type
            output.append(_header(metric.name + _SUFFIX.get(mtype, ""), metric.documentation,
                                  _TYPES.get(mtype, mtype)))
            base = metric.name
            for s in metric.samples:
                name = s.name
                if name.startswith(base) and name[len(base):] in _OM_SUFFIXES:
                    om_samples.setdefault(name[len(base):], []).append(_sample_line(s))
                else:
                    output.append(_sample_line(s))
        except Exception as exception:
            exception.args = (exception.args or ("",)) + (metric,)
            raise
        for suffix, lines in sorted(om_samples.items()):
            output.append(_header(metric.name + suffix, metric.documentation, "gauge"))
            output.extend(lines)
    return "".join(output).encode("utf-8")
