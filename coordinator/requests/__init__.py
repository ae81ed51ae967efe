"""Running requests, with no HTTP in sight: each request's lifetime, its output state, the load balancer, the
backend seam and the backend over the cluster. Failures are `coordinator.requests.errors` (or amoe's own errors);
the API room decides what status each one gets."""
