"""The coordinator: OpenAI-compatible API server, request state and load balancer (no model code)."""
