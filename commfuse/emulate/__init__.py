"""An emulated cluster network on one Linux machine: one network namespace per rank, links
shaped by the kernel (tbf) at a preset's rates, inside a node and between nodes, so a step's
communication runs on the wire while its compute runs on the cores, as on a cluster.

`python -m commfuse emulate --preset NAME --nodes N --ranks-per-node R -- CMD ...` runs CMD once
per rank as torchrun would (docs/emulate.md). The presets and their conventions:
``commfuse.emulate.presets``; the namespaces: ``commfuse.emulate.netns``; the launcher:
``commfuse.emulate.launch``.
"""

from commfuse.emulate.launch import emulated_topology, network_spec, run_emulated
from commfuse.emulate.presets import PRESETS, NetworkPreset, preset

__all__ = ["PRESETS", "NetworkPreset", "emulated_topology", "network_spec", "preset", "run_emulated"]
