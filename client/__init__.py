"""omnidraft.client (see README)."""
