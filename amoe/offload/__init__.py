"""Expert offloading (MoE-Infinity, arXiv 2401.14361): experts stay on a slower tier and at most a budget of them is
resident; a policy decides what to evict and what to fetch ahead. docs/offload.md describes the whole path."""
