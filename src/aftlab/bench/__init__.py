"""aftlab.bench (being written)."""
