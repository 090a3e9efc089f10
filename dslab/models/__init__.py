"""dslab.models."""
