"""Hydra search-path plugin: makes the ``tq/*`` config groups available to every Hydra app.

Only what belongs in other apps is on this search path, as Hydra's own launcher plugins expose
only ``hydra/launcher/...``: ``tq/backend``, ``tq/staging`` and ``tq/packing`` (the YAML under
``hydra_plugins/tq_plugin/conf``). The recipes' own groups and primary configs (``model``,
``task``, ``recipe``, ``trainer``, ``logger``, ``callbacks``, ``train``) live in
``tq_plugin.conf`` and are found through the recipes' entry point (its ``config_path``).

Hydra imports every module under the ``hydra_plugins`` namespace on each start, so this stays thin:
it imports only the torch-free schema package, whose import registers the typed schemas the
shipped YAML options extend (root configs named ``tq_schema_*``, kept out of ``--help``).
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

import tq_plugin.config  # noqa: F401  (registers the ConfigStore schemas)

SEARCH_PATH = "pkg://hydra_plugins.tq_plugin.conf"


class TQPluginSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://hydra_plugins.tq_plugin.conf``: ``tq/backend``, ``tq/staging``,
    ``tq/packing``."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="tq_plugin", path=SEARCH_PATH)
