"""Tuning tables: the tiles and thresholds each kernel runs with, per shape, as measured on Hopper GPUs.

Kernel files hold the kernels; this module holds the numbers that pick their tiles, so a retune touches one file.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- expert kernels


# ------------------------------------------------------------------------------------------ router and packing
