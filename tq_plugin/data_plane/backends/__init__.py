"""Data-plane backends. ``local`` is embedded and the default; only an adapter imports Ray or transferqueue."""

from tq_plugin.data_plane.backends.local import LocalDataPlane
from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

__all__ = ["LocalDataPlane", "RayDataPlane"]
