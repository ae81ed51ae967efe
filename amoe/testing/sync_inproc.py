"""The synchronous modes in one process, for tests: amoe.runtime.sync.group (production code uses it too, for
`amoe generate --parallel ep`)."""

from amoe.runtime.sync.group import MODES, SyncCluster

__all__ = ["MODES", "SyncCluster"]
