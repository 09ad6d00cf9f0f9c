"""Small helpers both sides use: atomic writes, process settings."""
