"""The aft-conv mixer (stub: being written)."""
