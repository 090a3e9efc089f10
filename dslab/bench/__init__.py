"""dslab.bench."""
