"""A user's mistake reads as one message naming what to change, and nothing else on the console:
a reward function returning the wrong number of values (no lookup of its name as a module), a
reward module that is not on the import path (where Python looked and how to put it there), an
empty ``model.pretrained_path`` (the key, not a traceback)."""

from __future__ import annotations

import inspect
import logging
import sys

import pytest

from tq_plugin import cli
from tq_plugin.config import ConfigError
from tq_plugin.rl.tasks.rewards import RewardCall, RewardError, load_reward

HINT = cli.FULL_ERROR_HINT


def wrong_length(completions, **_):
    return [0.5]


def test_a_reward_returning_the_wrong_count_is_named_where_it_is_defined(caplog, capsys):
    reward = load_reward({"_target_": f"{__name__}.wrong_length"}, key="task.reward")
    call = RewardCall(prompts=["p", "q"], completions=["a", "b"], completion_ids=[[1], [2]],
                      columns={})
    with pytest.raises(RewardError) as info:
        reward(call)
    with caplog.at_level(logging.DEBUG):
        lines = cli.describe_error(info.value)
    line = inspect.getsourcelines(wrong_length)[1]
    assert lines[:2] == ["tq-train: reward wrong_length: returned 1 values for 2 completions",
                         f"  the function: {__name__}.wrong_length at {__file__}:{line}"]
    # Nothing else is printed or logged on the way (it once looked the name up as a module).
    assert not caplog.records and capsys.readouterr() == ("", "")


def test_a_reward_module_not_on_the_import_path_says_so_and_how_to_fix_it(
        tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as info:
        load_reward({"_target_": "no_such_reward_module.fn"}, key="task.reward")
    assert str(info.value) == ("task.reward._target_: cannot import 'no_such_reward_module.fn': "
                               "no module named 'no_such_reward_module' on the import path "
                               "(PYTHONPATH, the installed packages)")
    assert cli.describe_error(info.value) == [
        f"tq-train: {info.value}",
        ("  fix: run from the folder that holds no_such_reward_module.py, or put that folder "
         "on the import path: PYTHONPATH=<folder> tq-train ..."),
    ]
    assert not caplog.records and capsys.readouterr() == ("", "")
    # Where the run put the working directory on the path (tq-train does), the message says so.
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"\(PYTHONPATH, the installed packages, the working "
                                          rf"directory {tmp_path}\)"):
        load_reward({"_target_": "no_such_reward_module.fn"}, key="task.reward")


def test_a_reward_target_that_imports_but_fails_is_told_apart(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "broken_reward_mod.py").write_text("import not_installed_dependency_xyz\n")
    (tmp_path / "fine_reward_mod.py").write_text("def fn(completions, **_):\n    return []\n")
    with pytest.raises(ConfigError, match=r"importing broken_reward_mod raised "
                                          r"ModuleNotFoundError: No module named "
                                          r"'not_installed_dependency_xyz'"):
        load_reward({"_target_": "broken_reward_mod.fn"}, key="task.reward")
    with pytest.raises(ConfigError, match=r"fine_reward_mod has no 'fnn'"):
        load_reward({"_target_": "fine_reward_mod.fnn"}, key="task.reward")
    assert load_reward({"_target_": "fine_reward_mod.fn"}, key="task.reward").name == "fn"
    with pytest.raises(ConfigError, match=r"'fn' is not module.function"):
        load_reward({"_target_": "fn"}, key="task.reward")


def test_an_empty_pretrained_path_is_one_message_naming_the_key(tmp_path, monkeypatch, capsys):
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["tq-train", f"hydra.run.dir={tmp_path / 'run'}",
                                      "model=hf_causal_lm", "model.pretrained_path="])
    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as info:
        cli.main()
    GlobalHydra.instance().clear()
    assert info.value.code == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert err.strip().splitlines() == [
        ("tq-train: model.pretrained_path: is empty: name a local save_pretrained directory "
         "(model.pretrained_path=<dir>), or null for a model initialised at random"),
        ("  fix: change model.pretrained_path on the command line (key=value); every key: "
         "docs/reference/config.md"),
        HINT]
