"""aftlab.data (being written)."""
