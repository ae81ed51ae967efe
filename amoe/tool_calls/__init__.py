"""Tool calls in a model's output: the wire formats the served families write, read piece by piece into OpenAI's
`tool_calls` (torch-free: the coordinator reads them)."""
