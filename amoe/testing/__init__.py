"""Test and experiment harnesses, kept apart from production code: several runtimes in one process (AEP and the
synchronous modes over the loopback communicator), a real served cluster driven from Python, and the pure-Python
scheduling policies the C++ scheduler is checked against. Nothing in amoe/ outside this package imports it."""
