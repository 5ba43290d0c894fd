"""One exposition for a router instance of several processes: their samples merged.

Counters, histograms and the arrival-rate gauge add up across processes (each process sees
its share of the traffic); the policy gauges take the highest value (version, age, staleness:
the instance is as old as its oldest process), the health and tokenizer gauges the lowest
(an instance is healthy only where every process says so); ``_created`` samples the earliest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

MAX_GAUGES = frozenset({"pdrouter_policy_version", "pdrouter_policy_age_seconds",
                        "pdrouter_policy_stale"})
MIN_GAUGES = frozenset({"pdrouter_tokenizer_loaded", "pdrouter_instance_healthy"})


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def merge_expositions(texts: Iterable[str]) -> str:
    """The text exposition of the processes' merged samples (families in first-seen order)."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, (fam.type, fam.documentation))
            bucket = samples.setdefault(fam.name, {})
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = bucket.get(key)
                if old is None:
                    bucket[key] = s.value
                elif s.name.endswith("_created"):
                    bucket[key] = min(old, s.value)
                elif fam.type == "gauge" and fam.name in MAX_GAUGES:
                    bucket[key] = max(old, s.value)
                elif fam.type == "gauge" and fam.name in MIN_GAUGES:
                    bucket[key] = min(old, s.value)
                else:
                    bucket[key] = old + s.value
    out: list[str] = []
    for name, (kind, doc) in families.items():
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        for (sample, labels), value in samples[name].items():
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            out.append(f"{sample}{{{lab}}} {_value(value)}" if lab
                       else f"{sample} {_value(value)}")
    return "\n".join(out) + "\n"
