"""Hypothesis profiles: "ci" (default, sized for CI) and "dev" (larger, for local runs).

Select with HYPOTHESIS_PROFILE=dev python -m pytest -q.
"""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
