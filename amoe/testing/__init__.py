"""Test and experiment harnesses, kept apart from production code: several runtimes in one process (AEP and the
synchronous modes over the loopback communicator), a real served cluster driven from Python, `amoe serve` as a
child process (ServerProcess), and the pure-Python scheduling policies the C++ scheduler is checked against.
Nothing that serves imports it; only the studies (amoe.perf.studies), which drive servers as the tests do."""
