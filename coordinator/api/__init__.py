"""The OpenAI-compatible HTTP surface: request and response bodies, validation into prepared requests, OpenAI-shaped
errors (the only place a failure becomes an HTTP status), API key and body-size limits, and the FastAPI app."""
