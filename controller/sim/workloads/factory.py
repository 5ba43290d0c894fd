"""``build_workload``: a :class:`WorkloadConfig` to a ready workload (see ``base``)."""

from __future__ import annotations

from controller.data import TRACES_DIR
from controller.sim.workloads.base import Workload, WorkloadConfig
from controller.sim.workloads.compose import TransformedWorkload


def build(cfg: WorkloadConfig) -> Workload:
    traces_dir = TRACES_DIR
    time_slice = cfg.time_slice_s
    workload: Workload
    if cfg.source == "mooncake":
        from controller.sim.workloads.mooncake import MooncakeWorkload

        workload = MooncakeWorkload.from_params(cfg.params, traces_dir)
    elif cfg.source in ("azure-conv", "azure-code"):
        from controller.sim.workloads.azure import AzureWorkload

        workload = AzureWorkload.from_params(cfg.source, cfg.params, traces_dir)
    elif cfg.source == "servegen":
        from controller.sim.workloads.servegen import ServeGenWorkload

        # ServeGen spans 14 days: generate only the slice instead of slicing afterwards
        workload = ServeGenWorkload.from_params(cfg.params, traces_dir, time_slice)
        time_slice = None
    else:
        from controller.sim.workloads.synthetic import SyntheticWorkload

        workload = SyntheticWorkload.from_params(cfg.params)
    if time_slice is None and cfg.rate_scale == 1.0:
        return workload
    return TransformedWorkload(workload, time_slice_s=time_slice, rate_scale=cfg.rate_scale)
