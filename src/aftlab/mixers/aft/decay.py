"""The aft-decay mixer (stub: being written)."""
