"""passmgr."""
