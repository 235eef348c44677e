"""``hetpilot demo``: the whole control plane on one machine, no GPU, no network.

A daemon, three node agents declaring unequal EMULATED devices, and a 4-rank
gloo trainer learning scikit-learn's digits; mid-run one device is slowed and
a link throttled (EMULATED, through :mod:`hetpilot.emulation`), and the same
run measures a static even data-parallel plan for comparison. See
:mod:`hetpilot.demo.run`.
"""
