"""The built wheel alone ships the Hydra plugin and the YAML: a fresh environment composes the
shipped groups from another directory (not only an editable install)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = textwrap.dedent(
    """
    import hydra, tq_plugin
    from omegaconf import OmegaConf

    @hydra.main(version_base="1.3", config_path=None)
    def main(cfg):
        print("TQ_PLUGIN_FILE", tq_plugin.__file__)
        print(OmegaConf.to_yaml(cfg))

    main()
    """
)


@pytest.mark.slow
def test_wheel_ships_plugin_and_configs(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(dist), str(ROOT)], check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("tq_plugin-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hydra_plugins/tq_plugin/__init__.py" in names
    assert "hydra_plugins/__init__.py" not in names
    assert "tq_plugin/rl/recipe.py" in names and "tq_plugin/cli.py" in names
    for yaml in ("train.yaml", "recipe/grpo.yaml"):  # the recipe's own configs
        assert f"tq_plugin/conf/{yaml}" in names, yaml
    for yaml in ("tq/packing/sequence_packing.yaml", "tq/staging/media.yaml",
                 "tq/backend/local.yaml"):  # what every Hydra app sees, through the plugin
        assert f"hydra_plugins/tq_plugin/conf/{yaml}" in names, yaml

    # A fresh venv without the project: the wheel unpacked by pip into its own directory, and
    # the project venv's third-party packages (torch, hydra, ...) behind it. The editable
    # install's path hook is not active there (a .pth-listed directory's .pth files are ignored).
    target = tmp_path / "wheel_site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                    "--target", str(target), str(wheel)], check=True, timeout=300)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(f"{target}\n{sysconfig.get_paths()['purelib']}\n")

    app_dir = tmp_path / "elsewhere"
    app_dir.mkdir()
    (app_dir / "app.py").write_text(APP)
    out = subprocess.run(  # noqa: PLW1510  (the return code is asserted below)
        [str(py), "app.py", "+tq/packing=sequence_packing", "tq.packing.train_mb_tokens=2048",
         "+tq/staging=media", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=app_dir, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"TQ_PLUGIN_FILE {target}" in out.stdout  # the wheel's copy, not the checkout
    assert "use_sequence_packing: true" in out.stdout and "train_mb_tokens: 2048" in out.stdout
    assert "capture_media: true" in out.stdout

    info = subprocess.run([str(py), "app.py", "--info", "searchpath"], cwd=app_dir, check=True,
                          capture_output=True, text=True, timeout=300)
    assert "pkg://hydra_plugins.tq_plugin.conf" in info.stdout

    # The recipes' primary config composes from the wheel too (what `tq-train` runs).
    job = subprocess.run([str(py), "-m", "tq_plugin.cli", "recipe=grpo", "--cfg", "job"],  # noqa: PLW1510
                         cwd=app_dir, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "algorithm: grpo" in job.stdout
