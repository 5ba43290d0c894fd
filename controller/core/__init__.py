"""Pure decisions, no I/O.

Windows, features, drift, fit, table build, weight tuning, rollout plan: values in, values out.
"""
