"""Every shipped config group option composes, validates and instantiates (fast tier, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

import hydra_plugins.tq_plugin
import tq_plugin
from tq_plugin.config import PackingConfig, validate_config

CONF = Path(tq_plugin.__file__).parent / "conf"  # the recipes' groups and primary configs
PLUGIN_CONF = Path(hydra_plugins.tq_plugin.__file__).parent / "conf"  # tq/*, in every app
GROUPS = ["tq/backend", "tq/staging", "tq/packing", "task", "model", "trainer", "recipe",
          "logger", "callbacks"]


def _options(group: str) -> list[str]:
    root = PLUGIN_CONF if group.startswith("tq/") else CONF
    return sorted(p.stem for p in (root / group).glob("*.yaml"))


_DISTRIBUTED = {("tq/backend", "ray"), ("tq/backend", "transferqueue")}  # start Ray / TQ
CASES = [
    pytest.param(g, o, id=f"{g}={o}",
                 marks=[pytest.mark.slow, pytest.mark.timeout(300)] if (g, o) in _DISTRIBUTED else [])
    for g in GROUPS for o in _options(g)
]


@pytest.fixture
def compose_train(tmp_path):
    """Compose the recipes' primary config from the installed package, as the entry points do."""

    def _compose(*overrides: str, config_name: str = "train"):
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
            cfg = compose(
                config_name,
                overrides=[f"hydra.run.dir={tmp_path}", *overrides],
                return_hydra_config=True,
            )
        HydraConfig().set_config(cfg)
        return cfg

    yield _compose
    GlobalHydra.instance().clear()


def test_every_group_has_options():
    assert all(_options(g) for g in GROUPS)
    assert _options("tq/packing") == ["dynamic_batching", "none", "sequence_packing"]
    assert _options("tq/staging") == ["media", "text"]


def _select(compose_train, group: str, option: str) -> str:
    """``group=option``, or ``+group=option`` while the primary config does not list the group."""
    compose_train()
    listed = group in HydraConfig.get().runtime.choices
    return f"{group}={option}" if listed else f"+{group}={option}"


@pytest.mark.parametrize(("group", "option"), CASES)
def test_option_composes_validates_and_instantiates(compose_train, tmp_path, group, option, request):
    # A run sets hydra.runtime.output_dir (the loggers' save_dir); compose leaves it unset.
    cfg = compose_train(_select(compose_train, group, option),
                        f"hydra.runtime.output_dir={tmp_path}")
    typed = validate_config(cfg)
    node = OmegaConf.select(cfg, group.replace("/", "."))
    assert HydraConfig.get().runtime.choices[group] == option
    if group == "tq/backend":
        from tq_plugin.data_plane import LocalDataPlane, RayDataPlane

        if option == "ray":
            request.getfixturevalue("ray_session")  # attach to the session's loopback Ray
        elif option == "transferqueue":
            request.getfixturevalue("tq_session")  # attach to the session's TransferQueue
            from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane
        expected = {"local": LocalDataPlane, "ray": RayDataPlane}.get(option) or TransferQueueDataPlane
        with open_dict(node):
            if option != "local":
                node.store = f"compose-{option}"
        client = instantiate(node)
        try:
            assert isinstance(client, expected)
            client.register_partition("p", fields=[])
            assert client.list_sample_ids("p") == []
        finally:
            client.close()
    elif group == "tq/staging":
        from tq_plugin.data_plane import LocalDataPlane
        from tq_plugin.staging import TQTokenSink

        client = LocalDataPlane()
        sink = instantiate(node)(client)
        assert isinstance(sink, TQTokenSink)
        assert sink.capture_media is (option == "media")
        assert sink.staging_partition in client.list_partitions()
        client.close()
    elif group == "tq/packing":
        packing = instantiate(node)
        assert isinstance(packing, PackingConfig) and packing.mode == option
        assert packing == typed["tq.packing"]
    elif group == "task" and option == "prompts":
        pytest.importorskip("datasets", reason="the prompts extra is not installed")
        from tq_plugin.rl.tasks.tiny_text import reverse_rows, train_tokenizer

        rows = reverse_rows(4)
        (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokenizer = train_tokenizer([r["answer"] for r in rows])
        tokenizer.save_pretrained(str(tmp_path / "tok"))
        task = instantiate(node, path=str(tmp_path / "p.jsonl"), tokenizer=str(tmp_path / "tok"))
        assert task.vocab_size == len(tokenizer) and task.eos_token_id == tokenizer.eos_token_id
        assert len(task.rows) == 4  # rewards are named as TRL names them: the function's name
        assert task.rewards[0].name == node.reward._target_.rsplit(".", 1)[-1]
    elif group == "task" and option == "agent":
        pytest.importorskip("datasets", reason="the prompts extra is not installed")
        from hydra.errors import InstantiationException

        (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
        with pytest.raises(InstantiationException, match="task.agent._target_: task=agent needs"):
            instantiate(node, path=str(tmp_path / "p.jsonl"))  # no agent named yet
    elif group == "task" and option == "reasoning_gym":
        pytest.importorskip("reasoning_gym", reason="the gym extra is not installed")
        from tq_plugin.rl.tasks.tiny_text import train_tokenizer

        train_tokenizer(["12 + 34 - 5 = 41"]).save_pretrained(str(tmp_path / "tok"))
        task = instantiate(node, tokenizer=str(tmp_path / "tok"), size=8, eval_size=4)
        assert len(task.rows) == 8 and len(task.eval_rows) == 4
        assert [r.name for r in task.rewards] == ["score"]
    elif group == "task":
        task = instantiate(node)
        assert task.vocab_size > task.num_symbols
    elif group == "model":
        from torch import nn

        from tq_plugin.rl.models.tiny import TinyTransformer

        model = instantiate(node, vocab_size=16)
        assert isinstance(model, TinyTransformer if option == "tiny_transformer" else nn.Module)
    elif group == "trainer":
        import lightning.pytorch as pl
        import torch

        if node.accelerator == "gpu" and not torch.cuda.is_available():
            pytest.skip(f"trainer={option} needs a CUDA GPU to instantiate (composed and "
                        "validated above)")
        trainer = instantiate(node, max_steps=1, enable_progress_bar=False, logger=False,
                              default_root_dir=str(tmp_path))
        assert isinstance(trainer, pl.Trainer)
        assert Path(trainer.default_root_dir) == tmp_path
    elif group == "recipe":  # trl_defaults: GRPO at TRL's defaults (tests/docs/test_coming_from_trl.py)
        assert typed["recipe"].algorithm == {"trl_defaults": "grpo"}.get(option, option)
    elif group == "logger":
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        from tq_plugin.lightning.instantiators import instantiate_loggers

        extra = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}.get(option)
        if extra:
            pytest.importorskip(extra, reason=f"the {extra} extra is not installed")
        (logger,) = instantiate_loggers(cfg.logger)
        if option in ("wandb", "mlflow"):  # a run starts on first use; the store is the run dir's
            assert type(logger).__name__ == {"wandb": "WandbLogger", "mlflow": "MLFlowLogger"}[option]
            assert str(tmp_path) in str(logger.save_dir)
        else:
            assert isinstance(logger, {"csv": CSVLogger, "tensorboard": TensorBoardLogger}[option])
            assert Path(logger.save_dir) == tmp_path
    elif group == "callbacks":
        from tq_plugin.lightning.instantiators import instantiate_callbacks
        from tq_plugin.lightning.progress import StepProgressBar

        built = instantiate_callbacks(cfg.get("callbacks"))
        assert [type(c) for c in built] == ([StepProgressBar] if option == "default" else [])
        # trainer.enable_progress_bar=false: Lightning refuses a progress-bar callback.
        assert instantiate_callbacks(cfg.get("callbacks"), progress_bar=False) == []


@pytest.mark.parametrize("config_name", ["train", "ppo", "grpo"])
def test_primary_configs_compose(compose_train, config_name):
    cfg = compose_train(config_name=config_name)
    typed = validate_config(cfg)
    assert typed["recipe"].algorithm == ("grpo" if config_name == "grpo" else "ppo")
    assert "sweep_report" in cfg.hydra.callbacks


@pytest.mark.parametrize("packing", ["none", "sequence_packing", "dynamic_batching"])
def test_swept_keys_apply_to_every_packing_option(compose_train, packing):
    cfg = compose_train(f"tq/packing={packing}", "tq.packing.train_mb_tokens=2048")
    packing_cfg = validate_config(cfg)["tq.packing"]
    assert packing_cfg.train_mb_tokens == 2048
    assert packing_cfg.mode == packing
    assert set(OmegaConf.to_container(cfg.tq.packing)) == set(PackingConfig.__dataclass_fields__)


def test_packing_host_attributes_feed_the_driver_mixin(compose_train):
    from tq_plugin.lightning.driver import TQDriverMixin

    packing = instantiate(compose_train("tq/packing=dynamic_batching").tq.packing)
    host = TQDriverMixin()
    host.cfg = packing.model_cfg()
    host.configure_packing(**packing.host_attributes())
    spa, dba = host._packing_args("train_mb_tokens")
    assert spa is None and dba["max_tokens_per_microbatch"] == packing.train_mb_tokens


# ----------------------------------------------------------------------- bad overrides
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tq.packing.train_mb_tokens=lots", "tq.packing.train_mb_tokens"),
        ("tq.packing.use_sequence_packing=maybe", "tq.packing.use_sequence_packing"),
        ("tq.packing.bogus=1", "Key 'bogus' not in 'PackingConfig'"),
        ("tq.staging.capture_media=sometimes", "tq.staging.capture_media"),
        ("model.d_model=wide", "model.d_model"),
        ("recipe.ppo_epochs=two", "recipe.ppo_epochs"),
        ("recipe.not_a_knob=3", "Key 'not_a_knob' not in 'RecipeConfig'"),
        ("tq/packing=greedy", "Could not find 'tq/packing/greedy'"),
    ],
)
def test_bad_override_fails_at_compose_naming_the_key(compose_train, override, message):
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(override)
    assert message in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tq.packing.use_dynamic_batches=true"],
         "tq.packing.use_sequence_packing / tq.packing.use_dynamic_batches"),
        (["tq/packing=none", "tq.packing.layout=packed"], "tq.packing.layout"),
        (["tq.packing.train_mb_tokens=0"], "tq.packing.train_mb_tokens: must be > 0"),
        (["tq.staging.media_pixel_dtype=null", "tq/staging=media"], "tq.staging.media_pixel_dtype"),
        (["recipe.ppo_epochs=0"], "recipe.ppo_epochs: must be > 0"),
        (["recipe=grpo", "recipe.group_size=1"], "recipe.group_size"),
        (["model.n_heads=3"], "model.d_model: must be divisible by model.n_heads"),
        (["task.min_len=9"], "task.min_len"),
        (["+tq.packing.extra=1"], "tq.packing: unknown key(s) ['extra']"),
    ],
)
def test_cross_field_rules_fail_validation_naming_the_key(compose_train, overrides, message):
    cfg = compose_train(*overrides)
    with pytest.raises(ValueError) as err:
        validate_config(cfg)
    assert message in str(err.value)


def test_both_packing_modes_refused_by_instantiate_too(compose_train):
    cfg = compose_train("tq.packing.use_dynamic_batches=true")
    with pytest.raises(Exception, match="mutually exclusive"):
        instantiate(cfg.tq.packing)


def test_unknown_group_silent_string_trap_is_caught(compose_train):
    # Hydra accepts `+group=option` for a group it does not know and adds a plain string key.
    cfg = compose_train("+tq/packng=none")
    assert cfg["tq/packng"] == "none"
    with pytest.raises(ValueError, match=r"unknown config group\(s\) \['tq/packng'\]") as err:
        validate_config(cfg)
    assert "Did you mean: tq/packng -> tq/packing?" in str(err.value)


# ----------------------------------------------------------------------- search-path plugin
def test_search_path_plugin_is_discovered():
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    from hydra_plugins.tq_plugin import TQPluginSearchPathPlugin

    assert TQPluginSearchPathPlugin in Plugins.instance().discover(SearchPathPlugin)


def test_groups_compose_in_an_app_without_a_config_dir():
    """Any Hydra app in the environment sees the shipped groups (and their typed schemas)."""
    GlobalHydra.instance().clear()
    with initialize(config_path=None, version_base="1.3"):
        cfg = compose(overrides=["+tq/packing=sequence_packing", "+tq/staging=media",
                                 "tq.packing.train_mb_tokens=2048"])
    GlobalHydra.instance().clear()
    assert cfg.tq.packing.use_sequence_packing is True
    assert cfg.tq.packing.train_mb_tokens == 2048
    assert cfg.tq.staging.capture_media is True
    assert OmegaConf.get_type(cfg.tq.packing) is PackingConfig


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("option", "fixture"), [("ray", "ray_session"), ("transferqueue", "tq_session")])
def test_distributed_backends_compose_and_instantiate_in_an_unrelated_app(option, fixture, request):
    """An app with no config of its own selects tq/backend=ray|transferqueue and gets a working
    client attached to the running (loopback) cluster."""
    request.getfixturevalue(fixture)
    GlobalHydra.instance().clear()
    with initialize(config_path=None, version_base="1.3"):
        cfg = compose(overrides=[f"+tq/backend={option}", f"tq.backend.store=unrelated-{option}"])
    GlobalHydra.instance().clear()
    validate_config(cfg)
    client = instantiate(cfg.tq.backend)
    try:
        assert client.shared
        client.register_partition("p", fields=[])
        client.put_samples(partition_id="p", sample_ids=["a"], fields={"x": torch.tensor([1.5])})
        assert client.get_samples(
            partition_id="p", sample_ids=["a"], select_fields=["x"]
        )["x"].tolist() == [1.5]
    finally:
        client.close()


def test_other_apps_see_only_the_tq_groups():
    """The plugin puts tq/backend, tq/staging and tq/packing on every app's search path, nothing
    else: no recipe groups, no schema group (so an unrelated app's --help lists neither)."""
    GlobalHydra.instance().clear()
    with initialize(config_path=None, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = set(loader.list_groups(""))
        tq_groups = set(loader.list_groups("tq"))
        # An unknown group only becomes a plain string key (Hydra's trap; validate_config
        # catches the misspelled-group form): the recipe's model config is not composed.
        cfg = compose(overrides=["+model=tiny_transformer"])
    GlobalHydra.instance().clear()
    assert cfg.model == "tiny_transformer"
    assert not groups & {"model", "task", "recipe", "trainer", "logger", "callbacks"}, groups
    assert tq_groups == {"backend", "staging", "packing"}  # no tq/schema group either
    assert "tq_schema_packing" not in groups


def test_recipe_entry_point_finds_its_groups_and_the_tq_groups(compose_train):
    cfg = compose_train("model=tiny_transformer", "tq/packing=none")
    assert cfg.model.name == "tiny_transformer" and cfg.tq.packing.name == "none"
