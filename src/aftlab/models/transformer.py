"""Practical Transformer models (stub: being written)."""
__all__: list[str] = []
