"""dslab.profilers."""
