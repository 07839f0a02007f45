"""The aft-simple mixer (stub: being written)."""
