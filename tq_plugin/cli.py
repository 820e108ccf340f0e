"""``tq-train``: the recipes' Hydra entry point (installed console script).

``tq-train --help`` says what it does, shows example commands, lists the config groups with their
options and says where runs are written (:func:`help_text`); ``tq-train --help-all`` is Hydra's
own help (every key with its value) and ``--hydra-help`` Hydra's flags.

Errors a user can fix print as a few lines instead of a traceback (:func:`describe_error`): a
``ConfigError`` names the key, a ``RewardError`` the reward function with its file and line, an
``EngineError`` the engine; an unknown key or option on the command line gets "did you mean"
(:func:`check_overrides`). ``HYDRA_FULL_ERROR=1`` shows the whole traceback instead.

Results go to Hydra's output dir (``metrics.csv``, ``resolved_config.yaml``, ``reward_curve.png``,
``result.json``); a multirun ends with ``comparison.{csv,md,png}`` in the sweep dir.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import re
import sys
import sysconfig
import textwrap
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig

CONFIG_PATH = "pkg://tq_plugin.conf"
CONFIG_MODULE = "tq_plugin.conf"
PROG = "tq-train"
FULL_ERROR_HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
log = logging.getLogger("tq_plugin")

# One line per config group: what choosing an option of it decides. Every group the recipes'
# config search path holds must be here (tests/docs/test_cli_help.py); `tq-train --help` and the
# generated configuration reference (docs/hooks/config_reference.py) both print them.
GROUP_DOCS: dict[str, str] = {
    "recipe": "the RL algorithm and its hyper-parameters (recipe.topology: colocated or "
              "disaggregated)",
    "task": "what the policy learns: the synthetic pattern task, or your prompts file scored by "
            "your reward functions",
    "model": "the policy (and PPO's value) network: a tiny transformer, or a transformers "
             "causal LM from a local directory",
    "engine": "what generates rollouts: the recipes' own sampler, transformers with a KV cache, "
              "or vLLM in-process",
    "trainer": "the Lightning Trainer: one CPU process, DDP or FSDP2 ranks, one or N GPUs",
    "tq/backend": "where the rows live: the embedded store, a Ray actor, or TransferQueue",
    "tq/staging": "the partition every model call's tokens (and, with media, pixels) are "
                  "staged into",
    "tq/packing": "how a step is cut into microbatches: padded rows, dynamic batches, packed rows",
    "logger": "where metrics go besides metrics.csv (several: logger=[csv,tensorboard])",
    "callbacks": "extra Lightning callbacks: the RL-step progress bar, or none",
}

EXAMPLES: tuple[tuple[str, str], ...] = (
    ("tq-train", "PPO on the synthetic pattern task, embedded store (what `make run` runs)"),
    ("tq-train recipe=grpo recipe.num_steps=50 tq/packing=dynamic_batching",
     "GRPO for 50 RL steps, microbatches cut by a token budget"),
    (("tq-train --config-name grpo task=prompts task.path=prompts.jsonl "
      "task.reward._target_=my_reward.reward model=hf_causal_lm model.pretrained_path=DIR"),
     "your prompts, your reward function (called as TRL calls it), your local model"),
    ("tq-train trainer=ddp_cpu tq/backend=ray",
     "2 DDP ranks sharing one store in a Ray actor (on loopback, token-authenticated)"),
    (("tq-train -m hydra/sweeper=tq_dedup tq/packing=none,sequence_packing "
      "tq.packing.train_mb_tokens=256,1024"),
     "a sweep, each distinct run once; comparison.{csv,md,png} in the sweep dir"),
)


def output_dir() -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()


def run(cfg: DictConfig) -> dict[str, Any]:
    """Build the recipe named by ``cfg.recipe._target_``, train it and return its summary."""
    from tq_plugin.rl.training.metrics import format_summary

    # Lightning prints through its own console handler; without this Hydra's root handler
    # repeats every Lightning line.
    logging.getLogger("lightning.pytorch").propagate = False
    recipe = get_class(cfg.recipe._target_)(cfg, output_dir())
    recipe.setup()
    recipe.train()
    summary = recipe.cleanup()
    if summary is None:  # a DDP rank other than 0: rank 0 reports the run
        return {}
    backend = cfg.tq.backend._target_.rsplit(".", 1)[-1]
    print(f"\n[tq_plugin] {cfg.recipe.algorithm} on {backend}, packing={summary['packing']}, "
          f"results in {output_dir()}\n{format_summary(summary)}{_samples_line()}", flush=True)
    return summary


def _samples_line() -> str:
    """The summary's line naming the run's sample-completion files, where it wrote any."""
    from tq_plugin.rl.training.evaluation import EVAL_COMPLETIONS_FILE
    from tq_plugin.rl.training.metrics import COMPLETIONS_FILE

    names = [n for n in (COMPLETIONS_FILE, EVAL_COMPLETIONS_FILE) if (output_dir() / n).exists()]
    return f"\nsample completions with their rewards: {', '.join(names)}" if names else ""


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR", "") not in ("", "0")


def _task(cfg: DictConfig) -> dict[str, Any]:
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if not multirun:
        try:
            return run(cfg)
        except Exception as exc:
            lines = None if _full_error() else describe_error(exc)
            if lines is None:
                raise  # Hydra prints it (the whole trace with HYDRA_FULL_ERROR=1)
            _report(lines)
            raise SystemExit(1) from None
    # In a sweep one failed job must not stop the others, nor vanish: record it and carry on.
    try:
        return run(cfg)
    except Exception as exc:
        lines = describe_error(exc)
        if lines is None:
            log.exception("sweep job failed")
        else:
            log.error("sweep job failed:\n%s", "\n".join(lines))
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
        from tq_plugin.rl.training.metrics import RESULT_FILE

        out = output_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
        return result


def _report(lines: Sequence[str], *, trace_hint: bool = True) -> None:
    """Write the lines to stderr, after closing any progress bar still open on the console (so the
    message starts on a line of its own), then, with ``trace_hint``, how to see the traceback."""
    sys.stdout.flush()
    tqdm = sys.modules.get("tqdm.std")
    bars = list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ())
    for bar in bars:
        bar.leave = False
        bar.close()
    sys.stderr.write(("\n" if bars else "") + "\n".join(
        [*lines, *([FULL_ERROR_HINT] if trace_hint else [])]) + "\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------------------ errors
# Matched by class name through the MRO, most specific first, so the error classes' modules are
# imported only by the code that raises them (and a Ray-wrapped RewardError still matches).
_KINDS = ("RewardError", "EngineError", "ConfigError")
_KEY = re.compile(r"^([A-Za-z_][\w\-/]*(?:\.[\w\-]+)*(?:\[\d+\])?(?: / [A-Za-z_][\w.\-]*)*): ")
_LIBRARY_DIRS = tuple(
    str(Path(p).resolve()) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib",
                                                                        "platlib")} if p)
_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _kind(exc: BaseException) -> tuple[str, BaseException] | None:
    for link in _chain(exc):
        for cls in type(link).__mro__:
            if cls.__name__ in _KINDS:
                return cls.__name__, link
    return None


def _library(filename: str) -> bool:
    path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return (filename.startswith("<") or path.startswith(_PACKAGE_DIR)
            or any(path.startswith(d) for d in _LIBRARY_DIRS)
            or "site-packages" in path or "dist-packages" in path)


def _where(frame: traceback.FrameSummary) -> str:
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{frame.name}() at {frame.filename}:{frame.lineno}{code}"


def _reward_function(err: BaseException, message: str) -> str | None:
    """Where the reward a ``RewardError`` names is defined (``module.fn at file:line``, which
    the error carries), else its name as the message says it."""
    where = getattr(err, "where", None)
    if where:
        return str(where)
    match = re.match(r"reward (\S+?):", message)
    return match.group(1) if match else None


def describe_error(exc: BaseException) -> list[str] | None:
    """A few lines for an error the user can fix, or ``None`` (print the traceback).

    * ``RewardError``: the message, the reward function's file and line (and where inside it
      the exception was raised), what a reward function must do;
    * ``EngineError``: the message and which engines serve which models;
    * ``ConfigError`` (``PackingConfigError`` too): the message and the key to change.
    """
    found = _kind(exc)
    if found is None:
        return None
    kind, err = found
    message = " ".join(str(err).split()) or type(err).__name__
    lines = [f"{PROG}: {message}"]
    if kind == "RewardError":
        cause = err.__cause__
        # The first frame is the caller that caught the exception (the reward runner).
        frames = traceback.extract_tb(cause.__traceback__)[1:] if cause is not None else []
        user = [f for f in frames if not _library(f.filename)]
        user = user or [f for f in frames if not f.filename.startswith(_PACKAGE_DIR)]
        if user:
            lines.append(f"  in {_where(user[0])}")
            if len(user) > 1:
                lines.append(f"  raised in {_where(user[-1])}")
        else:
            where = _reward_function(err, message)
            if where:
                lines.append(f"  the function: {where}")
        lines.append("  fix: it is called by keyword (prompts, completions, completion_ids, the "
                     "file's columns, trainer_state)")
        lines.append("       and returns one number (or None) per completion "
                     "(docs/bring-your-own.md#reward-functions)")
    elif kind == "EngineError":
        lines.append("  fix: engine=native runs any model; engine=hf and engine=vllm serve "
                     "model=hf_causal_lm")
        lines.append("       (docs/topologies.md#rollout-engines)")
    elif getattr(err, "fix", None):  # the error says how to fix it
        lines.append(f"  fix: {err.fix}")
    else:
        key = _KEY.match(message)
        what = f"change {key.group(1)}" if key else "change the setting it names"
        lines.append(f"  fix: {what} on the command line (key=value); every key: "
                     "docs/reference/config.md")
    return lines


# ------------------------------------------------------------------ overrides, before Hydra
def _flat_keys(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, DictConfig):
        for key in node:
            dotted = f"{prefix}{key}"
            yield dotted
            child = node._get_node(key)  # no interpolation is resolved
            if isinstance(child, DictConfig | ListConfig):
                yield from _flat_keys(child, dotted + ".")


def _first_values(overrides: Sequence[str]) -> list[str] | None:
    """The overrides with each sweep replaced by its first value (what one job composes)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001
        return None  # Hydra reports the parse error itself
    out = []
    for override in parsed:
        if override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()), None)
            if first is None:
                return None
            out.append(f"{override.get_key_element()}={first}")
        else:
            out.append(override.input_line)
    return out


# TRL's GRPOConfig names a ported script sets that are spelt differently here, and the tq-train
# key (or group option) of each; a name spelt the same (beta, temperature, loss_type, ...) needs
# no entry. docs/coming-from-trl.md maps every name; tests/docs/test_coming_from_trl.py keeps the
# page and this table in agreement.
TRL_NAMES = {
    # optimisation
    "learning_rate": "recipe.lr", "lr_scheduler_type": "recipe.lr_scheduler",
    "optim": "recipe.optimizer", "max_steps": "recipe.num_steps",
    "num_iterations": "recipe.ppo_epochs", "steps_per_generation": "recipe.minibatches",
    "per_device_train_batch_size": "recipe.prompts_per_step (x recipe.group_size completions)",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "bf16": "trainer.precision=bf16-mixed",
    # generation
    "num_generations": "recipe.group_size", "max_completion_length": "recipe.max_new_tokens",
    "use_vllm": "engine=vllm", "shuffle_dataset": "task.shuffle",
    # loss and the engine's importance-sampling correction
    "epsilon": "recipe.clip_eps", "epsilon_high": "recipe.clip_eps_high",
    "vllm_importance_sampling_mode": "recipe.is_correction.mode",
    # rewards, evaluation, logging, checkpoints
    "reward_weights": "task.rewards.<name>.weight", "eval_steps": "recipe.eval_every",
    "log_completions": "recipe.log_completions_every", "save_steps": "recipe.checkpoint_every",
    "report_to": "logger=csv|tensorboard|wandb|mlflow", "output_dir": "hydra.run.dir",
}


def _trl_name(key: str) -> str | None:
    """The tq-train key for a TRL GRPOConfig name typed as a key (``recipe.learning_rate``)."""
    leaf = key.rsplit(".", 1)[-1]
    return TRL_NAMES.get(leaf)


def _suggest(word: str, candidates: Sequence[str]) -> list[str]:
    """The closest candidates: by the whole dotted key, or by its last part (a key under the
    wrong group); the best and any within 0.05 of it, at most 3."""
    def score(candidate: str) -> float:
        whole = difflib.SequenceMatcher(None, word, candidate).ratio()
        leaf = difflib.SequenceMatcher(None, word.rsplit(".", 1)[-1],
                                       candidate.rsplit(".", 1)[-1]).ratio()
        return max(whole, 0.95 * leaf if leaf >= 0.8 else 0.0)

    scored = sorted(((score(c), c) for c in set(candidates)), key=lambda sc: (-sc[0], sc[1]))
    best = scored[0][0] if scored else 0.0
    return [c for s, c in scored if s >= max(0.6, best - 0.05)][:3]


def check_overrides(config_name: str, overrides: Sequence[str]) -> list[str] | None:
    """Compose the config as Hydra is about to; on an unknown key or option, the lines that name
    it and the closest ones (``did you mean``). ``None``: nothing to report (Hydra runs, and
    reports anything else the compose API cannot see)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException, MissingConfigException

    first = _first_values(overrides)
    if first is None:
        return None
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            try:
                compose(config_name, overrides=first)
                return None
            except MissingConfigException as exc:
                return _missing_option(str(exc))
            except ConfigCompositionException as exc:
                return _bad_override(str(exc), exc.__cause__, config_name, first, compose)
    except Exception:  # noqa: BLE001  (never in the way: Hydra composes and reports again)
        return None


def _missing_option(message: str) -> list[str] | None:
    match = re.search(r"Could not find '([^']+)/([^'/]+)'", message)
    if not match:
        return None
    group, option = match.groups()
    listed = re.search(rf"Available options in '{re.escape(group)}':\n((?:\t.*\n?)+)", message)
    options = [o.strip() for o in listed.group(1).splitlines()] if listed else []
    lines = [f"{PROG}: {group} has no option '{option}'"]
    hint = _suggest(option, options)
    if hint:
        lines.append(f"  did you mean {group}={hint[0]}?")
    if options:
        lines.append(f"  options of {group}: {', '.join(options)}")
    return lines


def _bad_override(message: str, cause: BaseException | None, config_name: str,
                  overrides: list[str], compose: Any) -> list[str] | None:
    unknown = re.match(r"Could not override '([^']+)'", message)
    if unknown and "not in" in str(cause):
        key = unknown.group(1)
        others = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
        keys: list[str] = []
        for attempt in (others, []):
            try:
                cfg = compose(config_name, overrides=attempt, return_hydra_config=True)
                keys = list(_flat_keys(cfg))
                break
            except Exception:  # noqa: BLE001, S112  (another bad override: try without any)
                continue
        if "/" in key:  # a group Hydra does not know: tq/packng=none
            groups = list(GROUP_DOCS)
            lines = [f"{PROG}: unknown config group '{key}'"]
            hint = _suggest(key, groups)
            value = next((o.split("=", 1)[1] for o in overrides if "=" in o
                          and o.split("=", 1)[0].lstrip("+~") == key), "...")
            if hint:
                lines.append(f"  did you mean {hint[0]}={value}?")
            lines.append(f"  the groups: {', '.join(groups)} (`{PROG} --help`)")
            return lines
        trl = _trl_name(key)
        if trl is not None:  # a TRL name with a known equivalent: that one line says it all
            return [(f"{PROG}: unknown config key '{key}': did you mean {trl} (TRL's "
                    f"{key.rsplit('.', 1)[-1]})?")]
        lines = [f"{PROG}: unknown config key '{key}'"]
        hint = _suggest(key, [k for k in keys if "/" not in k])
        if hint:
            lines.append(f"  did you mean {' or '.join(hint)}?")
        lines.append(f"  every key with its value: `{PROG} --help-all`; a key of your own: "
                     f"+{key}=...")
        return lines
    merging = re.match(r"Error merging override (\S+)", message)
    if merging and cause is not None:
        detail = str(cause).splitlines()[0]
        return [f"{PROG}: {merging.group(1)}: {detail}",
                "  every key with its type and default: docs/reference/config.md"]
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    return [f"{PROG}: {first_line}", *(f"  {line}" for line in message.strip().splitlines()[1:4])]


# --------------------------------------------------------------------------------- --help
@dataclass(frozen=True)
class Group:
    """One config group of the recipes' search path: its options and the default's name."""

    name: str
    options: tuple[str, ...]
    default: str | None
    doc: str


@functools.lru_cache(maxsize=8)
def config_groups(config_name: str = "train") -> tuple[Group, ...]:
    """Every group of the recipes' config search path (``hydra/*`` left out), in
    :data:`GROUP_DOCS` order, with its options and the option ``config_name`` selects."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        choices = compose(config_name, return_hydra_config=True).hydra.runtime.choices

        def walk(parent: str = "") -> Iterator[str]:
            for name in loader.list_groups(parent):
                full = f"{parent}/{name}" if parent else name
                if full != "hydra":
                    yield full
                    yield from walk(full)

        found = {g: tuple(loader.get_group_options(g)) for g in walk()}
    found = {g: opts for g, opts in found.items() if opts}
    order = [g for g in GROUP_DOCS if g in found] + sorted(set(found) - set(GROUP_DOCS))
    return tuple(Group(g, found[g], choices.get(g), GROUP_DOCS.get(g, "")) for g in order)


def help_text(config_name: str = "train", width: int = 100) -> str:
    """What ``tq-train --help`` prints."""
    wrap = textwrap.TextWrapper(width=width)
    intro = wrap.fill(
        "tq-train runs RL post-training (PPO or GRPO) of a policy with PyTorch Lightning, "
        "configured with Hydra. Each RL step generates rollouts, stages every model call's tokens "
        "in the data plane (a keyed columnar store), scores them with the task's reward, writes "
        "logprobs, values and advantages back as columns, and trains on microbatches read "
        "from the store. Pick a component with group=option; set any key with key=value; add "
        "-m to sweep over comma-separated values.")
    out = [f"usage: {PROG} [--config-name NAME] [-m] [group=option ...] [key=value ...]", "",
           intro, "", "examples:"]
    for command, what in EXAMPLES:
        out.append(textwrap.fill(command, width=width, initial_indent="  ",
                                 subsequent_indent="      ", break_on_hyphens=False))
        out.append(textwrap.fill(what, width=width, initial_indent="      # ",
                                 subsequent_indent="      # "))
    out += ["", f"config groups (--config-name {config_name}; * marks the default):"]
    groups = config_groups(config_name)
    column = max(len(g.name) for g in groups) + 2
    for group in groups:
        options = ", ".join(o + ("*" if o == group.default else "") for o in group.options)
        out.append(textwrap.fill(
            f"{group.name:<{column}}{options}", width=width, initial_indent="  ",
            subsequent_indent=" " * (column + 2)))
        out.append(textwrap.fill(group.doc, width=width, initial_indent=" " * (column + 2),
                                 subsequent_indent=" " * (column + 2)))
    out += ["", *wrap.wrap(
        "runs are written to outputs/<algorithm>/<date>_<time>/ (set hydra.run.dir=DIR): "
        "tq-train.log, metrics.csv, result.json, resolved_config.yaml, reward_curve.png, "
        "engines.log (vLLM's and Ray's own logs; verbose=true shows them), completions.jsonl "
        "(task=prompts: sample completions with each reward, every "
        "recipe.log_completions_every steps and the last), eval_completions.jsonl (the "
        "held-out completions of each evaluation), the "
        "final policy.safetensors (and value.safetensors), lightning_logs/ and checkpoints/. A "
        "sweep (-m) writes one folder per job under multirun/<algorithm>/<date>_<time>/ and "
        "comparison.{csv,md,png} beside them."), "",
        "more:",
        f"  {PROG} --help-all     Hydra's help: every key with its current value",
        f"  {PROG} --cfg job      print the composed config and exit",
        f"  {PROG} --hydra-help   Hydra's own flags (--multirun, --config-name, --info, ...)",
        "  HYDRA_FULL_ERROR=1      a full traceback instead of the short error message",
        "  docs/reference/config.md (on the site: make docs) every key: type, default, meaning"]
    return "\n".join(out) + "\n"


def _config_name(argv: Sequence[str], default: str) -> str:
    for i, arg in enumerate(argv):
        if arg in ("--config-name", "-cn") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config-name="):
            return arg.split("=", 1)[1]
    return default


def _overrides(argv: Sequence[str]) -> list[str] | None:
    """The command line's overrides, or ``None`` when a flag other than -m/--config-name is set."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--config-name", "-cn"):
            skip = True
        elif arg in ("-m", "--multirun") or arg.startswith("--config-name="):
            continue
        elif arg.startswith("-"):
            return None
        else:
            out.append(arg)
    return out


def main(config_name: str = "train") -> None:
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        sys.stdout.write(help_text(_config_name(argv, config_name)))
        return
    if "--help-all" in argv:
        sys.argv = [sys.argv[0], *("--help" if a == "--help-all" else a for a in argv)]
    elif not _full_error():
        overrides = _overrides(argv)
        lines = (check_overrides(_config_name(argv, config_name), overrides)
                 if overrides is not None else None)
        if lines:  # the command line's own mistake: no traceback to point at
            _report(lines, trace_hint=False)
            sys.exit(1)
    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(_task)()
    from tq_plugin.rl.training.sweep_report import LAST_REPORT

    if LAST_REPORT.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
