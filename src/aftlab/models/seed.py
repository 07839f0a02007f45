"""The definition's Transformer as a module (stub: being written)."""
__all__: list[str] = []
