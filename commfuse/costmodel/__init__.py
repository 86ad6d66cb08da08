"""Cost model, topology and (later) the timeline simulator."""

from .topology import PRESETS, Topology

__all__ = ["PRESETS", "Topology"]
