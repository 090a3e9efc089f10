"""dslab.engine."""
