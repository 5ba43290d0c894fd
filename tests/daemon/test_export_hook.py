"""The cycle hands every approved calibration's policy to ``on_approval`` ([export])."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.policy import Policy
from tests.daemon.fakes import make_rig


async def test_on_approval_sees_each_approved_policy_and_none_refused(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    seen: list[tuple[int, Any]] = []

    def record(policy: Policy, basis: Any) -> None:
        seen.append((policy.version, basis))

    rig.cycle.on_approval = record
    for _ in range(4):
        if (await rig.step()).approved_version == 1:
            break
    assert seen == [(1, None)]  # the scripted learner keeps no model: basis None
    rig.learner.approve = False
    rig.learner.fire = True
    report = await rig.step()
    assert report.trigger == "drift" and report.approved_version is None
    assert [v for v, _ in seen] == [1]
    rig.learner.approve = True
    rig.learner.fire = True
    assert (await rig.step()).approved_version == 2  # the refused candidate took none
    assert [v for v, _ in seen] == [1, 2]
    assert rig.store.desired_versions()  # the stored rollout went ahead as before


async def test_a_failing_hook_does_not_fail_the_cycle(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)

    def broken(policy: Policy, basis: Any) -> None:
        raise OSError("disk full")

    rig.cycle.on_approval = broken
    for _ in range(4):
        report = await rig.step()
        if report.approved_version == 1:
            break
    assert report.approved_version == 1
    assert set(rig.store.desired_versions().values()) == {1}


async def test_pdctl_run_wires_the_export_writer_only_when_configured(tmp_path: Path) -> None:
    from controller.config import load_settings
    from controller.daemon import Daemon
    from controller.exporter import ApprovalExporter

    for export, wired in (({}, False),
                          ({"format": "llm-d", "path": str(tmp_path / "d.yaml")}, True)):
        settings = load_settings(
            store={"url": f"sqlite:///{tmp_path / 'h.db'}"}, metrics={"enable": False},
            routers={"targets": ["127.0.0.1:1"]}, export=export)
        parts = await Daemon(settings).build()
        try:
            hook = parts.cycle.on_approval
            assert isinstance(hook, ApprovalExporter) if wired else hook is None
            if wired:
                assert isinstance(hook, ApprovalExporter) and hook.path == tmp_path / "d.yaml"
        finally:
            await parts.transport.close()
            await parts.source.aclose()
            parts.store.close()


async def test_the_hook_runs_after_the_approval_committed(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    stored_when_called: list[dict[str, int]] = []

    def record(policy: Policy, basis: Any) -> None:
        # Read through the store's own reads: inside the write transaction the approval
        # would not be visible yet to another connection.
        stored_when_called.append(dict(rig.store.desired_versions()))

    rig.cycle.on_approval = record
    for _ in range(4):
        if (await rig.step()).approved_version == 1:
            break
    assert stored_when_called and set(stored_when_called[0].values()) == {1}
