"""Builders and helpers shared by tests, benches and the demo: tiny models, a vLLM CPU server."""
