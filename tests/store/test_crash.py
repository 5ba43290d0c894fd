"""A process killed in the middle of a cycle leaves no trace of that cycle."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

from controller.store import Store
from tests.store.factories import sample_window

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, random, signal, sys
    from controller.store import Store
    from tests.store.factories import sample_window

    store = Store(sys.argv[1])
    with store.cycle() as tx:
        wid = tx.add_window(sample_window(random.Random(2), 1_900_000_000.0))
        tx.add_drift_event("workload", 0.9, 0.2, [wid])
        tx.add_policy(tx.next_version(), "ee" * 32, "{}", "approved", "half a cycle")
        tx.set_desired("r1", 2)
        tx.record_ack("r9", 50, "ff" * 32)
        tx.flush()  # the rows are in the database's hands, uncommitted
        print("flushed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_killed_mid_cycle_leaves_the_previous_state(store: Store) -> None:
    earlier = store.add_window(sample_window(random.Random(1), 1_899_999_970.0))
    store.add_policy(1, "aa" * 32, "{}", "approved", "before", at=datetime(2027, 1, 1, tzinfo=UTC))
    store.set_desired("r1", 1)

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, store.url.render_as_string(hide_password=False)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.strip() == "flushed"  # it really got as far as writing

    assert [w.id for w in store.windows()] == [earlier]
    assert store.drift_events() == []
    assert [p.version for p in store.policies()] == [1]
    assert store.desired_versions() == {"r1": 1}
    assert store.routers() == []
    assert store.next_version() == 2
    # and the database is still writable
    assert store.add_window(sample_window(random.Random(3), 1_900_000_030.0)) > earlier
