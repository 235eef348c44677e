"""hetpilot: keeps distributed DNN training fast on heterogeneous, changing GPU clusters."""

__version__ = "0.1.0"
