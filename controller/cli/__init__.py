"""``pdctl``: the command line. Each command family lives in its own module below."""

from __future__ import annotations

import importlib
import sys

from controller.cli._app import app

# Command modules register themselves on import. Heavy imports stay inside the commands so
# `pdctl --help` is fast.
_COMMAND_MODULES = (
    "config_cmd",
    "table_cmd",
    "agent_cmd",
    "router_cmd",
    "push_cmd",
    "bench_decide",
    "bench_fanout",
    "demo_cmd",
    "sim_cmd",
    "bench_run",
    "observe_cmd",
    "db_cmd",
    "history_cmd",
    "run_cmd",
    "ops_cmd",
    "explain_cmd",
    "active_cmd",
    "plan_cmd",
    "export_cmd",
)

for _name in _COMMAND_MODULES:
    try:
        importlib.import_module(f"controller.cli.{_name}")
    except ModuleNotFoundError as e:  # a family not built yet in this checkout
        if e.name != f"controller.cli.{_name}":
            raise


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        # The long-running daemon allocates through glibc so freed memory goes back to the
        # OS (controller/heap.py says why); a short command does not need it.
        from controller.heap import reexec_with_system_malloc

        reexec_with_system_malloc()
    app()


__all__ = ["app", "main"]
