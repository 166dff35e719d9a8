"""Benchmarks: scripts run by hand against real engines, not timed tests."""
