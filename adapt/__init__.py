"""Interference-aware adaptation: a random-forest slowdown estimator over
runtime statistics, the re-planning gate, and the staleness model of
asynchronous (PipeDream-style) pipelines. See docs/adaptation.md.

Nothing here imports torch at import time; scikit-learn is imported by the
estimator only when it fits.
"""
