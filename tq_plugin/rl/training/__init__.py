"""The Lightning side of a recipe: the module (``module``), its callbacks (``callbacks``, given
their collaborators, never the recipe), evaluation, the step record a step source hands the
trainer (``step_record``), rank reduction (``ranks``), metrics and artifacts (``metrics``),
loggers and the sweep report.

Nothing heavy is imported here: ``tq_plugin.rl.training.sweep_report`` is built by Hydra (as a
callback) before any job runs, and must stay torch-free."""
