"""Thin adapters from serving frameworks to the core's ``PrefixAttention`` plan/run API.

Each submodule imports its framework; importing this package imports none of them.
"""
