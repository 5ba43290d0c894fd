"""Helpers shared by several test packages (real components the tests start or reach)."""
