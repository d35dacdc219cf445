"""Hybrid LLM backbone built from a layer-pattern string."""
