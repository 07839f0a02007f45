"""The aft-full mixer (stub: being written)."""
