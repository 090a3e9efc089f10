"""dslab.report."""
