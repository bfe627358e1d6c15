"""Host planning: block table -> :class:`LaunchPlan` (numpy; no device work)."""

from .types import LaunchPlan, PlanArrays

__all__ = ["LaunchPlan", "PlanArrays"]
