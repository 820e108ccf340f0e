"""``make docs``: the site builds with warnings as errors, and holds what the README promises
(an index, an API page per package, the configuration reference with every group)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_site_builds_strictly(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (make install does)")
    site = tmp_path / "site"
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]

    index = (site / "index.html").read_text()
    assert "When to use it" in index and "NeMo RL" in index
    # site/index.html opened from the file system: links name .html files, and search reads its
    # index from a script and starts its worker through the shim shipped in docs/ (no server,
    # no network)
    assert 'href="getting-started.html"' in index and 'href="getting-started/"' not in index
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = ")
    assert '<script src="javascripts/iframe-worker-shim.js"' in index and "unpkg" not in index
    assert 'href="stylesheets/extra.css"' in index
    for package in ("data_plane", "staging", "lightning", "rollout", "config", "rl"):
        api = (site / "reference" / "api" / f"{package}.html").read_text()
        assert 'class="doc doc-heading"' in api, package
    api = (site / "reference" / "api" / "data_plane.html").read_text()
    for name in ("KVBatchMeta", "LocalDataPlane", "first_write", "shard_meta_for_dp"):
        assert f'id="tq_plugin.data_plane.{name}"' in api, name
    api = (site / "reference" / "api" / "rl.html").read_text()  # the parts a user calls too
    for name in ("recipe.RLRecipe", "tasks.prompts.PromptTask", "tasks.rewards.exact_match",
                 "algorithms.losses.policy_objective", "algorithms.registry.register_policy_loss"):
        assert f'id="tq_plugin.rl.{name}"' in api, name

    from tq_plugin import cli

    config = (site / "reference" / "config.html").read_text()
    for group in cli.config_groups("train"):
        assert re.search(rf"<h2 id=\"[^\"]*\">{re.escape(group.name)}", config), group.name
    for page in site.rglob("*.html"):  # every snippet and role was resolved
        text = page.read_text()
        assert "--8&lt;--" not in text and "--8<--" not in text, page
        assert ":func:<code>" not in text, page
