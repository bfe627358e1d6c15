"""Serving helpers that every engine integration shares."""
