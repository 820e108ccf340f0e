"""Hydra search-path plugin: makes tq_plugin's config groups available to every Hydra app.

Hydra imports every module under the ``hydra_plugins`` namespace on each start, so this stays thin:
it imports only the torch-free schema package, whose import registers the ``tq/schema/*``
structured configs the shipped YAML options extend.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

import tq_plugin.config  # noqa: F401  (registers the ConfigStore schemas)


class TQPluginSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://tq_plugin.conf``: ``tq/backend``, ``tq/staging``, ``tq/packing``, …"""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="tq_plugin", path="pkg://tq_plugin.conf")
