"""Fixtures for the trainer's tests and benchmarks: tiny jobs, rank functions, model pieces.

Not part of the trainer: nothing in :mod:`hetpilot.trainer` imports them. They are in the
package, as ``torch.testing._internal`` is in torch's, because ranks are spawned
processes that import them by module name (``hetpilot.trainer.testing.jobs:bn_tiny``),
which pytest's importlib mode does not allow for modules under tests/.
"""
