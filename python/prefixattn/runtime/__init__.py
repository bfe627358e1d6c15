"""Device stage: LaunchPlan -> attention output (compiled library, buffers, launches, reference)."""
