"""The runtimes of one deployment: the cluster manager, the launchers that start runtimes (child processes, node
agents, Ray actors), membership and health (the runtime table, the watchdog) and the control plane's socket. It
knows nothing of requests: what it hears for them goes to its `ClusterEvents` listener."""
