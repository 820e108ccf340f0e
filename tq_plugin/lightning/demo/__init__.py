"""Demos, in one place (as Lightning keeps ``demos/boring_classes``): shared by tests, docs,
benchmarks and the README.

* :mod:`~tq_plugin.lightning.demo.boring_classes`: ``DemoPolicy`` / ``DemoValue``, one-layer
  token models that adopt the whole integration in a few lines, and ``SyntheticRollouts``, a
  step source writing random rollouts.
* :mod:`~tq_plugin.lightning.demo.one_step`: one GRPO-shaped step through the embedded data
  plane, printed (``python -m tq_plugin.demo``).

The PPO/GRPO recipe (``tq_plugin.rl``) is the end-to-end example; it is not a demo surface.
"""

from tq_plugin.lightning.demo import boring_classes
from tq_plugin.lightning.demo.boring_classes import *  # the demos' public names

__all__ = list(boring_classes.__all__)
