"""Multi-head attention mixers (stub: being written). Registers "attention" and "attention-naive"."""
