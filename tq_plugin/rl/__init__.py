"""The recipes' reusable parts: tiny policy/value model, synthetic task, staged rollouts,
advantage estimators, the training module, metrics and the sweep report.

Nothing heavy is imported here: ``tq_plugin.rl.sweep_report`` is built by Hydra (as a callback)
before any job runs, and must stay torch-free.
"""
