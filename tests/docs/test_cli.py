"""``tq-train --help`` and the short error messages (``tq_plugin.cli``).

The fast tests call the functions in-process; the few subprocess tests (slow) run the installed
entry point as a user would: ``--help``, an unknown key, a reward function that raises.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tq_plugin import cli
from tq_plugin.config import ConfigError


# --------------------------------------------------------------------------------- --help
@pytest.fixture(scope="module")
def help_text() -> str:
    return cli.help_text("train")


def test_help_says_what_it_does_and_shows_five_examples(help_text):
    intro = help_text.split("\n\n")[1]
    assert "tq-train runs RL post-training" in intro and len(intro.split()) >= 40
    examples = help_text.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    commands = [line for line in examples.splitlines() if line.startswith("  tq-train")]
    assert len(commands) == 5, examples
    assert any("task=prompts" in c for c in commands) and any(" -m " in c for c in commands)


def test_help_lists_every_group_with_its_options_and_default(help_text):
    groups = cli.config_groups("train")
    names = {g.name for g in groups}
    assert {"recipe", "task", "model", "engine", "trainer", "tq/backend", "tq/staging",
            "tq/packing", "logger", "callbacks"} <= names
    for group in groups:
        assert group.doc, f"{group.name}: add its line to tq_plugin.cli.GROUP_DOCS"
        line = next(x for x in help_text.splitlines() if x.startswith(f"  {group.name} "))
        for option in group.options:
            assert option in line, (group.name, option)
        assert f"{group.default}*" in line, (group.name, group.default)
    assert not set(cli.GROUP_DOCS) - names, "GROUP_DOCS names a group that no longer exists"


def test_help_says_where_runs_go_and_how_to_get_hydras_help(help_text):
    assert "outputs/<algorithm>/<date>_<time>/" in help_text and "multirun/" in help_text
    assert "--help-all" in help_text and "--hydra-help" in help_text
    assert "HYDRA_FULL_ERROR=1" in help_text
    assert max(len(line) for line in help_text.splitlines()) <= 100


def test_help_follows_the_config_name():
    grpo = {g.name: g.default for g in cli.config_groups("grpo")}
    assert grpo["recipe"] == "grpo"
    assert "grpo*" in cli.help_text("grpo")


def test_main_prints_the_help_and_returns(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tq-train", "--help"])
    cli.main()
    assert capsys.readouterr().out == cli.help_text("train")


# --------------------------------------------------------------- overrides, before Hydra
@pytest.mark.parametrize(("override", "said"), [
    ("recipe.num_stepz=5", "did you mean recipe.num_steps?"),
    ("recipe.train_mb_tokens=64", "did you mean tq.packing.train_mb_tokens?"),
    ("trainer.devics=2", "did you mean trainer.devices?"),
    ("recipe=grpoo", "did you mean recipe=grpo?"),
    ("tq/packng=none", "did you mean tq/packing=none?"),
    ("recipe.learning_rate=1e-4", "did you mean recipe.lr (TRL's learning_rate)?"),
    ("recipe.num_generations=8", "did you mean recipe.group_size (TRL's num_generations)?"),
    ("recipe.lr_scheduler_type=cosine", "did you mean recipe.lr_scheduler (TRL's lr_scheduler_type)?"),
    ("recipe.optim=sgd", "did you mean recipe.optimizer (TRL's optim)?"),
    ("recipe.steps_per_generation=2",
     "did you mean recipe.minibatches (TRL's steps_per_generation)?"),
    ("recipe.use_vllm=true", "did you mean engine=vllm (TRL's use_vllm)?"),
])
def test_an_unknown_key_or_option_gets_did_you_mean(override, said):
    lines = cli.check_overrides("train", [override])
    assert lines is not None and said in "\n".join(lines), lines
    assert lines[0].startswith("tq-train: ") and len(lines) <= 4
    if "TRL's" in said:  # a TRL name with an equivalent: one line
        assert len(lines) == 1


def test_a_trl_name_prints_one_line_naming_ours(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tq-train", "recipe.learning_rate=1e-4"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 1
    assert capsys.readouterr().err == ("tq-train: unknown config key 'recipe.learning_rate': did "
                                       "you mean recipe.lr (TRL's learning_rate)?\n")


def test_good_overrides_and_sweeps_pass_the_check():
    assert cli.check_overrides("train", ["recipe=grpo", "recipe.num_steps=3"]) is None
    assert cli.check_overrides("grpo", ["tq/packing=none,sequence_packing",
                                        "tq.packing.train_mb_tokens=256,1024",
                                        "hydra/sweeper=tq_dedup"]) is None
    lines = cli.check_overrides("train", ["recipe.num_stepz=1,2"])  # a sweep's key is checked
    assert lines and "recipe.num_steps" in lines[1]


def test_a_bad_value_names_the_key():
    lines = cli.check_overrides("train", ["recipe.num_steps=abc"])
    assert lines and lines[0].startswith("tq-train: recipe.num_steps=abc: ")


# ----------------------------------------------------------------------- short errors
class RewardError(RuntimeError):
    """Matched by name, as tq_plugin.rl.tasks.rewards.RewardError is."""


class EngineError(ConfigError):
    """Matched by name, as tq_plugin.rollout.EngineError is."""


def _raise_from_user_code(tmp_path: Path) -> BaseException:
    user = tmp_path / "my_reward.py"
    user.write_text(textwrap.dedent("""\
        def helper(c):
            return 1 / len(c)


        def reward(completions, **kwargs):
            return [helper(c) for c in completions]
        """))
    namespace: dict = {}
    exec(compile(user.read_text(), str(user), "exec"), namespace)  # noqa: S102
    try:
        try:
            namespace["reward"](completions=["a", ""])
        except Exception as exc:
            raise RewardError("reward reward: raised ZeroDivisionError: division by zero") from exc
    except RewardError as err:
        return err
    raise AssertionError("unreachable")


def test_a_reward_error_names_the_function_file_and_line(tmp_path):
    lines = cli.describe_error(_raise_from_user_code(tmp_path))
    assert lines is not None and len(lines) <= 6
    text = "\n".join(lines)
    assert lines[0] == "tq-train: reward reward: raised ZeroDivisionError: division by zero"
    assert f"reward() at {tmp_path / 'my_reward.py'}:6" in text   # the function, its line
    assert f"helper() at {tmp_path / 'my_reward.py'}:2: return 1 / len(c)" in text  # the raise
    assert "fix:" in text


def test_a_wrapped_error_is_found_in_the_chain(tmp_path):
    try:
        try:
            raise _raise_from_user_code(tmp_path)
        except RewardError as err:
            raise RuntimeError("the data loader failed") from err
    except RuntimeError as outer:
        lines = cli.describe_error(outer)
    assert lines and lines[0].startswith("tq-train: reward reward: raised")


def test_a_config_error_names_the_key_and_an_engine_error_the_engines():
    lines = cli.describe_error(ConfigError("tq.packing.layout: 'packed' needs "
                                           "tq.packing.use_sequence_packing=true"))
    assert lines == [("tq-train: tq.packing.layout: 'packed' needs "
                     "tq.packing.use_sequence_packing=true"),
                     ("  fix: change tq.packing.layout on the command line (key=value); every "
                     "key: docs/reference/config.md")]
    engine = cli.describe_error(EngineError("engine: vllm needs model=hf_causal_lm"))
    assert engine and "engine=native runs any model" in engine[1]


def test_other_errors_keep_their_traceback():
    assert cli.describe_error(ValueError("a bug")) is None
    assert cli.describe_error(KeyError("x")) is None


# ------------------------------------------------------------------- as a user runs it
def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | env
    return subprocess.run([sys.executable, "-m", "tq_plugin.cli", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_command_line_help_and_an_unknown_key(tmp_path):
    shown = _run(["--help"], tmp_path)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: tq-train")
    typo = _run(["recipe.num_step=3"], tmp_path)
    assert typo.returncode == 1 and typo.stdout == ""
    assert typo.stderr.splitlines() == [
        "tq-train: unknown config key 'recipe.num_step'",
        "  did you mean recipe.num_steps?",
        ("  every key with its value: `tq-train --help-all`; a key of your own: "
        "+recipe.num_step=...")]  # no traceback hint: the command line's mistake has none
    full = _run(["--help-all"], tmp_path)
    assert full.returncode == 0 and "== Config ==" in full.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_reward_that_raises_prints_at_most_12_lines(tmp_path):
    subprocess.run([sys.executable, "-m", "tq_plugin.rl.tasks.tiny_text", "--out", "tiny"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (tmp_path / "bad_reward.py").write_text(textwrap.dedent("""\
        def score(completions, answer, **kwargs):
            return [len(c) / len(a.split("x")[3]) for c, a in zip(completions, answer)]
        """))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "reverse: a b", "answer": "b a"}\n'
                                            '{"prompt": "reverse: c d", "answer": "d c"}\n')
    args = ["--config-name", "grpo", "task=prompts", "task.path=prompts.jsonl",
            "task.reward._target_=bad_reward.score", "model=hf_causal_lm",
            "model.pretrained_path=tiny/model", "recipe.num_steps=2", "recipe.prompts_per_step=2",
            "trainer.enable_progress_bar=false"]
    proc = _run(args, tmp_path, PYTHONPATH=str(tmp_path))
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(out) <= 12, "\n".join(out)
    text = "\n".join(out)
    assert "Traceback" not in text
    assert re.search(r"score\(\) at .*bad_reward\.py:2", text), text
    assert "IndexError" in text and out[-1] == cli.FULL_ERROR_HINT

    full = _run(args, tmp_path, PYTHONPATH=str(tmp_path), HYDRA_FULL_ERROR="1")
    assert full.returncode == 1 and "Traceback" in full.stderr and "bad_reward.py" in full.stderr
