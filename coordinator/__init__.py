"""omnidraft.coordinator (see README)."""
