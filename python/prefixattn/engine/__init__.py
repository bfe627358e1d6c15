"""Serving helpers that every engine integration shares: the sharing probe and table hint
(:mod:`.sharing`) and the per-step planning policy (:mod:`.step`)."""
