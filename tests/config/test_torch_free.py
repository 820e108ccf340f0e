"""The schema package and the Hydra plugin import no torch: Hydra imports the plugin on every start."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "lightning", "tensordict", "pytorch_lightning")


def test_config_and_plugin_import_without_torch():
    code = (
        "import sys, tq_plugin.config, hydra_plugins.tq_plugin, hydra_plugins.tq_plugin.sweeper\n"
        "import tq_plugin.rl.training.sweep_report  # built by Hydra before any job runs\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"
