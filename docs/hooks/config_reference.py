"""The configuration reference, generated from the typed schemas and the shipped YAML options.

An MkDocs hook (``hooks:`` in ``mkdocs.yml``): at every build :func:`on_files` adds the page
``reference/config.md`` written by :func:`render`, so the reference cannot drift from the code.
For every config group of the recipes' search path (:func:`tq_plugin.cli.config_groups`) it lists
the options (with the first comment line of each option's YAML) and every key: its type (the
schema's annotation; for the groups without a schema, the type of the shipped values), its value
in each option, and one doc line.

A key's doc line is, first found: the comment above the field in ``tq_plugin/config/schema.py``,
an entry of :data:`KEY_DOCS` below, the comment heading the block of fields it belongs to (fields
that follow a commented one with no blank line between), the comment above the key in an
option's YAML. A key with none fails the build (and ``tests/docs/test_config_reference.py``):
document a new key with a comment above its schema field.

Run as a script to print the page: ``python docs/hooks/config_reference.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PAGE = "reference/config.md"

# Keys Hydra gives a meaning to, in every group.
HYDRA_KEYS = {
    "_target_": "the class or function Hydra instantiates for this node",
    "_partial_": "instantiate returns a partial: the caller supplies the remaining arguments",
    "_recursive_": "false: the nested nodes are passed as plain config, not instantiated first",
}

# Doc lines of keys whose schema field has no comment above it (the comment wins when one is
# added there). Keys are dotted as on the command line; an entry naming no key fails the tests.
KEY_DOCS: dict[str, str] = {
    # tq/backend
    "tq.backend.store": "name of the store (the partitions of one run live under it)",
    "tq.backend.actor_name": "name of the Ray actor that holds the store; processes attach to it "
                             "by this name",
    "tq.backend.namespace": "Ray namespace of the store actor",
    "tq.backend.op_timeout_s": "seconds one data-plane call may take before it fails",
    "tq.backend.num_storage_units": "TransferQueue storage units (each is a Ray actor and needs a "
                                    "CPU)",
    "tq.backend.init_timeout_s": "seconds TransferQueue may take to start",
    "tq.backend.ray_init": "arguments of ray.init when Ray is not running yet",
    # tq/staging
    "tq.staging.staging_partition": "partition every model call's token delta is staged into",
    "tq.staging.capture_media": "stage the pixels a call ran on in the same put as its tokens",
    "tq.staging.media_pixel_dtype": "dtype the staged pixels are stored in (float32, float16, "
                                    "bfloat16); needed with capture_media",
    # tq/packing
    "tq.packing.name": "the option's name (none, sequence_packing, dynamic_batching), reported "
                       "in metrics and sweeps",
    "tq.packing.use_sequence_packing": "bin-pack rows into microbatches of train_mb_tokens and "
                                       "train them as one packed row",
    "tq.packing.use_dynamic_batches": "group rows into microbatches under a token budget, each "
                                      "padded to its own length",
    "tq.packing.logprob_mb_tokens": "token budget of one logprob/value forward microbatch (the "
                                    "no-grad passes)",
    "tq.packing.algorithm": "bin-packing algorithm of sequence packing",
    "tq.packing.microbatch_order": "order the packed microbatches run in: the packer's, or "
                                   "largest_first; null: the packer's",
    # task (pattern)
    "task.name": "the option's name, reported in the run's summary",
    "task.num_symbols": "symbols the pattern is drawn from (the vocabulary grows with it)",
    "task.min_len": "shortest pattern",
    "task.max_len": "longest pattern",
    "task.turns": "turns per episode: after each answer the environment replies (GOOD/BAD, or "
                  "task.feedback_good/bad) and asks again",
    # task=prompts
    "task.path": "the prompts file: json/jsonl, parquet or csv, one prompt per row",
    "task.prompt_key": "the column that holds the prompt: text, or a list of {role, content} "
                       "chat messages",
    "task.feedback_good": "the environment's reply after a rewarded answer (turns > 1)",
    "task.feedback_bad": "the environment's reply after an unrewarded answer (turns > 1)",
    "task.eval_size": "rows of task.path held out for evaluation when task.eval_path is null",
    "task.shuffle": "draw prompts in a seeded shuffle, epoch after epoch (false: file order)",
    # model
    "model.name": "the option's name, reported in the run's summary",
    "model.d_model": "hidden size",
    "model.n_layers": "transformer layers",
    "model.n_heads": "attention heads (d_model must divide by it)",
    "model.max_seq_len": "longest sequence the model takes (prompt + every turn)",
    "model.dropout": "dropout probability while training, in [0, 1)",
    "model.model_type": "a transformers model type (llama, qwen2, gpt2, ...) whose config is "
                        "built with the sizes above",
    "model.pretrained_path": "a local save_pretrained directory to load instead (weights, sizes "
                             "and, for task=prompts, the tokenizer); nothing is downloaded",
    "model.attn_implementation": "attention kernel: sdpa or eager",
    # engine
    "engine.name": "the engine: native, hf or vllm",
    "engine.enforce_eager": "vllm: run eagerly, without CUDA graphs or torch.compile",
    # recipe
    "recipe.algorithm": "ppo (policy + value, GAE) or grpo (policy only, group-relative "
                        "advantages)",
    "recipe.seed": "seed of the run: model init, prompt order, sampling",
    "recipe.prompts_per_step": "prompts drawn per RL step",
    "recipe.group_size": "samples per prompt (GRPO normalises rewards within each group)",
    "recipe.ppo_epochs": "passes over each step's rows",
    "recipe.lr": "learning rate of the policy",
    "recipe.value_lr": "learning rate of the value model (PPO)",
    "recipe.clip_eps": "PPO clip range: the ratio is clamped to [1 - clip_eps, 1 + clip_eps]",
    "recipe.value_clip_eps": "clip range of the value loss (PPO)",
    "recipe.vf_coef": "weight of the value loss",
    "recipe.entropy_coef": "weight of the entropy bonus",
    "recipe.gamma": "discount of GAE (PPO)",
    "recipe.gae_lambda": "lambda of GAE (PPO)",
    "recipe.temperature": "sampling temperature of the rollouts",
    "recipe.max_new_tokens": "most tokens generated per turn",
    "recipe.train_partition": "data-plane partition the training rows are written to",
    "recipe.rollout_workers": "disaggregated: rollout worker processes",
    "recipe.log_every": "log to the console every this many RL steps",
    "recipe.is_correction.mode": "token_tis, seq_mask_tis, icepop or none (see "
                                 "recipe.is_correction)",
    "recipe.is_correction.min": "seq_mask_tis / icepop: lower bound of the kept ratio",
    "recipe.is_correction.max": "seq_mask_tis / icepop: upper bound of the kept ratio",
    # trainer (lightning.pytorch.Trainer arguments)
    "trainer.accelerator": "cpu or gpu",
    "trainer.devices": "processes (ranks) on this node: CPU processes or GPUs",
    "trainer.num_nodes": "nodes of a multi-node run",
    "trainer.precision": "32-true, or bf16-mixed on GPUs",
    "trainer.max_epochs": "set to 1: the recipe counts RL steps (max_steps comes from "
                          "recipe.num_steps x ppo_epochs x minibatches)",
    "trainer.enable_checkpointing": "Lightning's own checkpoint callback (the recipe's are "
                                    "recipe.checkpoint_every and the SIGTERM save)",
    "trainer.enable_progress_bar": "a progress bar on the console (callbacks=default counts RL "
                                   "steps)",
    "trainer.enable_model_summary": "Lightning's model summary at start",
    "trainer.log_every_n_steps": "how often Lightning hands metrics to the loggers",
    "trainer.strategy._target_": "Lightning's ModelParallelStrategy: FSDP2 over the "
                                 "data-parallel mesh",
    "trainer.strategy.data_parallel_size": "ranks the models are sharded over",
    "trainer.strategy.tensor_parallel_size": "1: tensor parallelism is not supported",
    "trainer.strategy.save_distributed_checkpoint": "checkpoints as a folder, one file per rank",
    # logger
    "logger.csv.save_dir": "where the logger writes (the run's output dir)",
    "logger.csv.name": "sub-folder of save_dir",
    "logger.tensorboard.save_dir": "where the event files go (the run's output dir)",
    "logger.tensorboard.name": "sub-folder of save_dir",
    "logger.tensorboard.default_hp_metric": "log TensorBoard's hp_metric placeholder",
    "logger.wandb.save_dir": "where the offline run is written (the run's output dir)",
    "logger.wandb.project": "W&B project",
    "logger.wandb.name": "W&B run name (null: W&B picks one)",
    "logger.wandb.mode": "offline unless WANDB_MODE says otherwise",
    "logger.wandb.log_model": "upload checkpoints to W&B",
    "logger.mlflow.save_dir": "the run's output dir; the file store is <save_dir>/mlruns",
    "logger.mlflow.experiment_name": "MLflow experiment",
    "logger.mlflow.tracking_uri": "a tracking server instead of the local file store",
    "logger.mlflow.run_name": "MLflow run name",
    "callbacks.rl_progress_bar._target_": "a progress bar counting RL steps, with the reward",
}


# Types of the primary config's own keys (it has no schema).
TOP_TYPES = {"ckpt_path": "str | None"}


# ------------------------------------------------------------------------------- sources
def _conf_dirs() -> list[Path]:
    import hydra_plugins.tq_plugin.conf as plugin_conf
    from tq_plugin import conf

    return [Path(conf.__file__).parent, Path(plugin_conf.__file__).parent]


def option_file(group: str, option: str) -> Path | None:
    """The YAML of ``group/option`` (``group`` empty: a primary config such as ``train``)."""
    for root in _conf_dirs():
        path = (root / group if group else root) / f"{option}.yaml"
        if path.is_file():
            return path
    return None


def _comment_text(lines: list[str]) -> str:
    return " ".join(line.strip().lstrip("#").strip() for line in lines).strip()


def yaml_comments(path: Path) -> tuple[str, dict[str, str]]:
    """The file's first comment paragraph and, per dotted key, the comment lines above it."""
    head: list[str] = []
    keys: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    in_head = True
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if in_head:
            if stripped.startswith("#") and not re.match(r"#\s{2,}\S", stripped):
                head.append(stripped)
                continue
            if stripped.startswith("#"):  # an example command: the description has ended
                continue
            in_head = False
            pending = []
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped)
            continue
        match = re.match(r"^(\s*)([A-Za-z_][\w]*):", raw)
        if match is None:
            pending = []
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([*(k for _, k in stack), key])
        stack.append((indent, key))
        if pending:
            keys[dotted] = _comment_text(pending)
        pending = []
    return _comment_text(head), keys


def _first_sentence(text: str) -> str:
    """Up to the first full stop outside brackets (or all of it)."""
    text = re.sub(r"\s+", " ", text).strip()
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " "):
            text = text[: i + 1]
            break
    return re.sub(r"(,? e\.g\.|:)$", ".", text)


def field_comments(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """Per dataclass field (own and inherited): the comment lines right above its definition,
    and, for a field with none that directly follows a commented one (no blank line between),
    that comment: the block documents the fields it heads."""
    own: dict[str, str] = {}
    shared: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        node = ast.parse(source).body[0]
        block = ""
        for stmt in getattr(node, "body", []):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                block = ""
                continue
            name = stmt.target.id
            above: list[str] = []
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i])
                i -= 1
            own.pop(name, None)
            shared.pop(name, None)
            if above:
                block = own[name] = _comment_text(above)
            elif block and i >= 0 and lines[i].strip():
                shared[name] = block
            else:
                block = ""
    return own, shared


# ----------------------------------------------------------------------------------- keys
@dataclasses.dataclass
class Key:
    dotted: str
    type: str
    values: dict[str, Any]  # option -> value (missing: the option lacks the key)
    doc: str = ""
    block_doc: str = ""  # the comment heading the block of fields this one follows


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__",
                                                                  str(annotation))
    return text.replace("typing.", "")


def _schema_keys(schema: type, prefix: str, values: dict[str, Any]) -> Iterator[Key]:
    hints = typing.get_type_hints(schema, include_extras=False, localns=vars(
        inspect.getmodule(schema)))
    docs, shared = field_comments(schema)
    for f in dataclasses.fields(schema):
        dotted = f"{prefix}.{f.name}"
        hint = hints.get(f.name)
        per_option = {o: (v.get(f.name, _MISSING) if isinstance(v, dict) else _MISSING)
                      for o, v in values.items()}
        # A nested node, also where it may be null (model.lora: LoraConfig | None).
        nested = [a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)]
        if nested:
            yield from _schema_keys(nested[0], dotted, per_option)
            continue
        yield Key(dotted, _type_name(f.type), per_option, docs.get(f.name, ""),
                  shared.get(f.name, ""))


_MISSING = object()


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for key, child in value.items():
            yield from _flatten(child, f"{prefix}.{key}")
    else:
        yield prefix, value


def _value_type(values: list[Any]) -> str:
    names = []
    for value in values:
        if value is _MISSING:
            continue
        name = {type(None): "null", bool: "bool", int: "int", float: "float", str: "str",
                list: "list", dict: "dict"}.get(type(value), type(value).__name__)
        if isinstance(value, str) and value.startswith("${"):
            name = "interpolation"
        if name not in names:
            names.append(name)
    names = [n for n in names if n != "null"] + (["null"] if "null" in names else [])
    return "any" if names in ([], ["null"]) else " | ".join(names)


@dataclasses.dataclass
class Table:
    """The keys shared by some options of a group: one schema, or one set of YAML keys."""

    options: list[str]
    schema: type | None
    keys: list[Key]


@dataclasses.dataclass
class GroupRef:
    name: str
    doc: str
    default: str | None
    options: dict[str, str]  # option -> first comment sentence of its YAML
    tables: list[Table]


def _compose_options(groups: list[Any]) -> dict[tuple[str, str], tuple[Any, type | None]]:
    """Each option's node, as composed in ``train``: the k-th compose selects the k-th option
    of every group that has one (a handful of composes instead of one per option)."""
    from hydra import compose
    from omegaconf import OmegaConf

    out = {}
    for k in range(max(len(g.options) for g in groups)):
        picks = {g.name: g.options[k] for g in groups if k < len(g.options)}
        cfg = compose("train", overrides=[f"{g}={o}" for g, o in picks.items()])
        for group, option in picks.items():
            node = OmegaConf.select(cfg, group.replace("/", "."))
            declared = OmegaConf.get_type(node) if node is not None else None
            data = OmegaConf.to_container(node, resolve=False) if node is not None else {}
            out[group, option] = (data or {},
                                  declared if dataclasses.is_dataclass(declared) else None)
    return out


@functools.lru_cache(maxsize=1)
def collect() -> tuple[list[GroupRef], dict[str, dict[str, str | None]], list[Key]]:
    """Every group with its tables, the primary configs' choices, and the top-level keys."""
    from hydra import compose, initialize_config_module

    from tq_plugin.cli import CONFIG_MODULE, config_groups

    groups = config_groups("train")
    primaries = {name: {g.name: g.default for g in config_groups(name)}
                 for name in ("train", "ppo", "grpo")}
    out: list[GroupRef] = []
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        every = _compose_options(groups)
        for group in groups:
            dotted = group.name.replace("/", ".")
            composed = {o: every[group.name, o] for o in group.options}
            options, yaml_docs = {}, {}
            for option in group.options:
                path = option_file(group.name, option)
                head, keys = yaml_comments(path) if path else ("", {})
                options[option] = _first_sentence(head)
                for key, doc in keys.items():
                    if key != "defaults":
                        yaml_docs.setdefault(f"{dotted}.{key}", doc)
            buckets: dict[Any, list[str]] = {}
            for option, (data, schema) in composed.items():
                bucket = schema if schema is not None else frozenset(data)
                buckets.setdefault(bucket, []).append(option)
            tables = []
            for bucket, members in buckets.items():
                values = {o: composed[o][0] for o in members}
                if isinstance(bucket, type):
                    keys = list(_schema_keys(bucket, dotted, values))
                else:
                    flat = {o: dict(_flatten(v, dotted)) if v else {} for o, v in values.items()}
                    names = list(dict.fromkeys(k for o in members for k in flat[o]))
                    keys = [Key(k, "", {o: flat[o].get(k, _MISSING) for o in members})
                            for k in names]
                    for key in keys:
                        key.type = _value_type(list(key.values.values()))
                for key in keys:
                    leaf = key.dotted.rsplit(".", 1)[-1]
                    key.doc = (key.doc or KEY_DOCS.get(key.dotted) or HYDRA_KEYS.get(leaf)
                               or key.block_doc or yaml_docs.get(key.dotted, ""))
                tables.append(Table(members, bucket if isinstance(bucket, type) else None, keys))
            out.append(GroupRef(group.name, group.doc, group.default, options, tables))
        cfg = compose("train")
        primary = option_file("", "train")
        _, primary_docs = yaml_comments(primary) if primary else ("", {})
        top = [Key(k, TOP_TYPES.get(k) or _value_type([cfg[k]]), {"train": cfg[k]},
                   KEY_DOCS.get(k) or primary_docs.get(k, ""))
               for k in cfg if k not in {g.name.split("/")[0] for g in groups}]
    return out, primaries, top


def missing_docs() -> list[str]:
    """Keys without a doc line (the build fails on any)."""
    groups, _, top = collect()
    keys = [k for g in groups for t in g.tables for k in t.keys] + top
    return sorted({k.dotted for k in keys if not k.doc})


def stale_key_docs() -> list[str]:
    """:data:`KEY_DOCS` entries that name no key of any group."""
    groups, _, top = collect()
    known = {k.dotted for g in groups for t in g.tables for k in t.keys} | {k.dotted for k in top}
    return sorted(set(KEY_DOCS) - known)


# --------------------------------------------------------------------------------- render
def _value(value: Any) -> str:
    if value is _MISSING:
        return ""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_value(v).strip('`')}" for k, v in value.items()) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(_value(v).strip("`") for v in value) + "]"
    else:
        text = str(value)
    return f"`{text}`" if text else "`''`"


def _cell(text: str) -> str:
    return text.replace("|", "&#124;").replace("\n", " ")


def render() -> str:
    groups, primaries, top = collect()
    out = [
        "# Configuration reference",
        "",
        ("<!-- Generated at build time by docs/hooks/config_reference.py from the typed schemas "
        "(tq_plugin.config.schema) and the shipped YAML options: edit those, not this page. -->"),
        "",
        ("Every config group of `tq-train` (and of `recipes/ppo.py`, `recipes/grpo.py`), its "
        "options and every key: its type, its value in each option, and what it does. Pick an "
        "option with `group=option`, set a key with `key=value`; a key the schema lacks is an "
        "error naming it (`tq-train --help` lists the groups, `tq-train --cfg job` prints the "
        "composed config). This page is generated from `tq_plugin.config` and the YAML under "
        "`conf/` and `hydra_plugins/tq_plugin/conf/` at every build, so it cannot drift from "
        "the code."),
        "",
        "## Primary configs",
        "",
        ("`tq-train` composes `train`; `--config-name ppo` or `--config-name grpo` (what "
        "`recipes/ppo.py` and `recipes/grpo.py` run) start from another default of `recipe`."),
        "",
        "| group | " + " | ".join(f"`{p}`" for p in primaries) + " |",
        "| --- | " + " | ".join("---" for _ in primaries) + " |",
    ]
    for group in groups:
        out.append(f"| [`{group.name}`](#{_anchor(group.name)}) | "
                   + " | ".join(f"`{primaries[p].get(group.name)}`" for p in primaries) + " |")
    out += ["", "Top-level keys:", "", "| key | type | default | what it does |",
            "| --- | --- | --- | --- |"]
    for key in top:
        out.append(f"| `{key.dotted}` | `{key.type}` | {_value(key.values['train'])} | "
                   f"{_cell(key.doc)} |")
    out += ["", ("Hydra's own keys that runs use: `hydra.run.dir` (the run's folder, default "
            "`outputs/<algorithm>/<date>_<time>`), `hydra.sweep.dir` (a multirun's), "
            "`hydra/sweeper=tq_dedup` (a sweep launches each distinct run once: `none` packing "
            "ignores the token budgets), `hydra/launcher=joblib` with "
            "`hydra.launcher.n_jobs=N` (jobs in parallel processes; extra `joblib`)."), ""]
    for group in groups:
        out += [f"## {group.name}", "", group.doc[0].upper() + group.doc[1:] + ".", "",
                "| option | what it is |", "| --- | --- |"]
        for option, doc in group.options.items():
            mark = " (default)" if option == group.default else ""
            out.append(f"| `{option}`{mark} | {_cell(doc)} |")
        out.append("")
        for table in group.tables:
            if not table.keys:
                out += [f"`{', '.join(table.options)}`: no keys.", ""]
                continue
            where = (f"Schema `{table.schema.__name__}` (`{table.schema.__module__}`)"
                     if table.schema is not None else "No schema (keys as shipped)")
            out += [f"{where}; options {', '.join(f'`{o}`' for o in table.options)}:", "",
                    "| key | type | " + " | ".join(f"`{o}`" for o in table.options)
                    + " | what it does |",
                    "| --- | --- | " + " | ".join("---" for _ in table.options) + " | --- |"]
            for key in table.keys:
                out.append(f"| `{key.dotted}` | `{key.type}` | "
                           + " | ".join(_cell(_value(key.values[o])) if key.values[o] is not
                                        _MISSING else "" for o in table.options)
                           + f" | {_cell(key.doc)} |")
            out.append("")
    return "\n".join(out) + "\n"


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", name.lower())


# ---------------------------------------------------------------------------- MkDocs hook
def on_files(files: Any, config: Any) -> Any:
    """Add the generated page; a key without a doc line fails the build."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    missing = missing_docs()
    if missing:
        raise PluginError("config keys without a doc line (add a comment above the schema "
                          f"field, or an entry in docs/hooks/config_reference.py): {missing}")
    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
