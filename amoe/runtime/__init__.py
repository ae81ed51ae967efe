"""Runtimes: the Python loop around the C++ engine, and the in-process wiring of several runtimes."""
