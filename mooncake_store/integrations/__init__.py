"""Adapters for inference engines and model libraries (imported lazily)."""
