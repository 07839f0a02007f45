"""The aft-local mixer (stub: being written)."""
