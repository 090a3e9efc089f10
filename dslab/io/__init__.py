"""dslab.io."""
