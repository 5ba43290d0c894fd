"""House rules from DESIGN §3 that a linter cannot see."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1] / "controller"
# Reading time anywhere but clock.py breaks virtual-time runs and replays.
TIME_READS = re.compile(
    r"\btime\.(time|monotonic|perf_counter|perf_counter_ns|time_ns|monotonic_ns)\(|"
    r"\bdatetime\.(now|utcnow|today)\(|\bdate\.today\("
)


def test_time_is_read_only_through_clock_py() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "clock.py" or "_proto" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if TIME_READS.search(line) and "# clock-ok" not in line:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert not offenders, "read time through controller.clock:\n" + "\n".join(offenders)
