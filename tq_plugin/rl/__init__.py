"""The RL recipe parts, in rooms that import one way: ``recipe`` (thin: setup, train, cleanup,
artifacts) -> ``topology`` (step sources, rollout workers) -> ``training`` (the Lightning
module, callbacks, metrics) -> ``models`` | ``tasks`` | ``algorithms``
(``tests/test_architecture.py`` enforces the order and that no import loops).

Nothing heavy is imported here: ``tq_plugin.rl.training.sweep_report`` is built by Hydra (as a
callback) before any job runs, and must stay torch-free.
"""
