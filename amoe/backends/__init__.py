"""Backends behind the coordinator's API: `local` runs the single-process reference engine in a thread."""
