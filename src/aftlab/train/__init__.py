"""aftlab.train (being written)."""
