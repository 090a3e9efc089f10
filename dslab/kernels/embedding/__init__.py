"""Embedding lookup with a deterministic weight gradient that folds in a tied head's (``embedding``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.embedding import embedding  # noqa: F401
