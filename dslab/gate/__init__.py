"""dslab.gate."""
