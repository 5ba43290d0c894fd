"""The control loop: the adapter around the pure rules of :mod:`controller.core`.

Each cycle gathers (observe a window, read the store), decides (the pure core), and applies
(one store transaction; metrics after it committed). :mod:`.cycle` runs it; :mod:`.learning`
is the learner glue around the core's drift and calibration; :mod:`.calibration_runner` runs
``pdctl calibrate-active``; :mod:`.capacity` plans capacity on :mod:`controller.core.capacity`
from stored windows; :mod:`.leader` holds leadership; :mod:`.metrics` is the daemon's
Prometheus registry.
"""
