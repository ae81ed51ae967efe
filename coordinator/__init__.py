"""The coordinator (no model code): three rooms whose imports point one way, api → requests → cluster.

- `coordinator.api`: the OpenAI-compatible surface: request bodies, validation, responses, HTTP errors, auth, limits.
- `coordinator.requests`: running requests: lifetime, output state, load balancer, the backend seam and the cluster
  backend; it raises its own errors (`coordinator.requests.errors`), which the API maps to HTTP.
- `coordinator.cluster`: the runtimes: manager, launchers, membership and health, the control plane.

`coordinator.metrics` sits beside them as a leaf: every room records into it, and it imports none of them.
"""
