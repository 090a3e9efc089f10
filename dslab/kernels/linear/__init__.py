"""Linear layers' reductions: column sums in fp32, the bias gradient of a Linear, and the Linear whose
backward uses them (``column_sum``).
"""

# Importing each op module registers its custom ops.
from dslab.kernels.linear import column_sum  # noqa: F401
