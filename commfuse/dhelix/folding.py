"""DHelix model folding (U-shaped layer map) and its W-shaped pipeline schedule, with a simulator.

Contract
- :func:`folded_layer_map` folds ``num_layers`` layers onto ``num_stages`` stages as a U:
  the layers are cut into 2*S equal chunks (virtual stages); chunk c < S goes to stage c,
  chunk c >= S to stage 2S-1-c. Stage 0 holds the first and the last chunk, and every
  stage holds the same number of layers as the unfolded 1F1B map (DHelix Sec. 4.1: G0
  hosts L0-L3 plus L28-L31 of 32 layers on 4 GPUs).
- :func:`w_schedule` builds the W-shaped schedule: a micro-batch's forward walks the
  virtual stages 0..2S-1 (devices 0..S-1, then S-1..0: a "V") and its backward walks them
  back (the same device sequence: a second "V"). Because strand beta's forward and strand
  alpha's backward visit the devices in the same order, they travel together as one
  *wave*: a wave is ``F`` only (warm-up, strand alpha filling the pipe), ``SI`` (forward of
  micro-batch i+w beside backward of micro-batch i, co-executed on every device — the
  strand-interleaved block) or ``B`` only (cool-down). Waves enter device 0 every 2 slots,
  the first backward may enter once its forward has left the pipe; in slot units (every
  block one slot) a wave is on the device of its step k at slot ``entry + k``, so two
  waves never meet on a device (the two visits of a device by one wave are an odd number
  of slots apart, entries an even number). ``w = min(S, m)`` warm-up waves.
- :func:`one_f_one_b` expresses the classical 1F1B (:mod:`commfuse.pipeline.schedule`) in
  the same block form (one block per stage action) for comparison.
- :func:`simulate` is a list-scheduling simulation: each device runs its blocks in the
  given order; a block starts when the device is free and every action it depends on has
  ended, plus ``latency`` when the producer ran on another device (a send/recv). Block
  durations come from a function of the block. It raises ``ValueError`` if the orders
  deadlock. The result lists every block's start/end, the makespan, busy and idle
  (bubble) time per device and the number of cross-device transfers.
- With unit block durations and zero latency the simulated bubble per device of the W
  schedule equals 1F1B's, 2(S-1) slots, for m >= S (tests), while the number of
  send/recv transfers doubles: 4(S-1) per micro-batch instead of 2(S-1) (the folded
  turn-around S-1 -> S and the final F -> B hand-over stay on one device). With real
  durations (SI block shorter than F + B) the bubble *time* share differs; the simulator
  reports it.

Source: DHelix (Wang et al.), Sec. 4.1 "Model Folding", Figs. 7-8; 1F1B from
PipeDream-Flush (Narayanan et al. 2021).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from commfuse.pipeline.schedule import stage_actions


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def folded_layer_map(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Stage of each layer under U-shaped folding (module docstring)."""
    _pos_int("num_layers", num_layers)
    s = _pos_int("num_stages", num_stages)
    if num_layers % (2 * s):
        raise ValueError(
            f"num_layers={num_layers} must be a multiple of 2 * num_stages = {2 * s} for folding"
        )
    per = num_layers // (2 * s)
    return tuple(vs if vs < s else 2 * s - 1 - vs for vs in (layer // per for layer in range(num_layers)))


def device_of(vstage: int, num_stages: int) -> int:
    """Device of virtual stage ``vstage`` (0..2S-1) under folding."""
    return vstage if vstage < num_stages else 2 * num_stages - 1 - vstage


@dataclass(frozen=True, order=True)
class ChunkAction:
    phase: str  # "F" | "B"
    microbatch: int
    vstage: int  # virtual stage (chunk) index

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}.{self.vstage}"


@dataclass(frozen=True)
class Block:
    """What one device runs between two barriers: one action, or an SI pair (F, B)."""

    device: int
    actions: tuple[ChunkAction, ...]

    @property
    def kind(self) -> str:
        return "SI" if len(self.actions) == 2 else self.actions[0].phase


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    num_stages: int
    num_vstages: int  # S for 1F1B, 2S for the folded W schedule
    microbatches: int
    orders: tuple[tuple[Block, ...], ...]  # per device
    device_of_vstage: tuple[int, ...]

    def deps(self, a: ChunkAction) -> tuple[ChunkAction, ...]:
        """Actions ``a`` needs first: previous virtual stage (F), next one (B), own forward (last B)."""
        last = self.num_vstages - 1
        if a.phase == "F":
            return () if a.vstage == 0 else (ChunkAction("F", a.microbatch, a.vstage - 1),)
        if a.vstage == last:
            return (ChunkAction("F", a.microbatch, last),)
        return (ChunkAction("B", a.microbatch, a.vstage + 1),)


def one_f_one_b(num_stages: int, microbatches: int) -> PipelineSchedule:
    """Classical 1F1B as blocks (one per stage action)."""
    s, m = _pos_int("num_stages", num_stages), _pos_int("microbatches", microbatches)
    orders = tuple(
        tuple(Block(d, (ChunkAction(a.phase, a.microbatch, d),)) for a in stage_actions("1f1b", s, d, m))
        for d in range(s)
    )
    return PipelineSchedule("1f1b", s, s, m, orders, tuple(range(s)))


def w_waves(num_stages: int, microbatches: int) -> list[tuple[int, tuple[tuple[str, int], ...]]]:
    """(entry slot, contents) of every wave; contents are (phase, microbatch) pairs."""
    s, m = _pos_int("num_stages", num_stages), _pos_int("microbatches", microbatches)
    w = min(s, m)
    contents: list[tuple[tuple[str, int], ...]] = [(("F", i),) for i in range(w)]
    contents += [(("F", w + k), ("B", k)) for k in range(m - w)]
    contents += [(("B", i),) for i in range(m - w, m)]
    f_entry: dict[int, int] = {}
    waves = []
    prev = -2
    for c in contents:
        entry = prev + 2
        for phase, mb in c:
            if phase == "B":  # the backward wave starts where its forward wave left (device 0)
                entry = max(entry, f_entry[mb] + 2 * s)
        for phase, mb in c:
            if phase == "F":
                f_entry[mb] = entry
        waves.append((entry, c))
        prev = entry
    return waves


def w_schedule(num_stages: int, microbatches: int) -> PipelineSchedule:
    """The folded W-shaped schedule (module docstring)."""
    s, m = _pos_int("num_stages", num_stages), _pos_int("microbatches", microbatches)
    dev = tuple(device_of(v, s) for v in range(2 * s))
    slots: list[list[tuple[int, Block]]] = [[] for _ in range(s)]
    for entry, contents in w_waves(s, m):
        for k in range(2 * s):  # step k of the wave: F at vstage k, B at vstage 2S-1-k, same device
            acts = tuple(ChunkAction(p, mb, k if p == "F" else 2 * s - 1 - k) for p, mb in contents)
            slots[dev[k]].append((entry + k, Block(dev[k], acts)))
    orders = []
    for d in range(s):
        times = [t for t, _ in slots[d]]
        if len(set(times)) != len(times):  # pragma: no cover - excluded by the parity argument
            raise AssertionError(f"w_schedule: two waves meet on device {d}")
        orders.append(tuple(b for _, b in sorted(slots[d], key=lambda x: x[0])))
    return PipelineSchedule("w-folded", s, 2 * s, m, tuple(orders), dev)


@dataclass(frozen=True)
class Timeline:
    schedule: PipelineSchedule
    blocks: tuple[tuple[Block, float, float], ...]  # (block, start, end), all devices
    action_end: Mapping[ChunkAction, float]
    makespan: float
    busy: tuple[float, ...]  # per device
    transfers: int  # cross-device dependencies (send/recv pairs)

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_share(self) -> float:
        """Idle fraction of all device time."""
        total = self.makespan * len(self.busy)
        return sum(self.bubble) / total if total else 0.0


def unit_durations(block: Block) -> float:
    return 1.0


def simulate(
    schedule: PipelineSchedule, duration: Callable[[Block], float] = unit_durations, *, latency: float = 0.0
) -> Timeline:
    """List-schedule ``schedule`` (module docstring)."""
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency!r}")
    dev = schedule.device_of_vstage
    heads = [0] * schedule.num_stages
    free = [0.0] * schedule.num_stages
    busy = [0.0] * schedule.num_stages
    end: dict[ChunkAction, float] = {}
    done: list[tuple[Block, float, float]] = []
    transfers = 0
    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for d, order in enumerate(schedule.orders):
            while heads[d] < len(order):
                blk = order[heads[d]]
                needs = [
                    (p, dev[p.vstage]) for a in blk.actions for p in schedule.deps(a) if p not in blk.actions
                ]
                if any(p not in end for p, _ in needs):
                    break
                start = max([free[d]] + [end[p] + (latency if pd != d else 0.0) for p, pd in needs])
                t = float(duration(blk))
                if t < 0:
                    raise ValueError(f"duration of block {blk} is negative: {t}")
                transfers += sum(1 for _, pd in needs if pd != d)
                for a in blk.actions:
                    end[a] = start + t
                free[d] = start + t
                busy[d] += t
                done.append((blk, start, start + t))
                heads[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [
                f"device {d}: {[str(a) for a in o[heads[d]].actions]}"
                for d, o in enumerate(schedule.orders)
                if heads[d] < len(o)
            ]
            raise ValueError(f"simulate: schedule {schedule.name!r} deadlocks; waiting: {stuck}")
    makespan = max((e for _, _, e in done), default=0.0)
    return Timeline(schedule, tuple(done), end, makespan, tuple(busy), transfers)


def phase_durations(f: float, b: float, si: float) -> Callable[[Block], float]:
    """Block durations: forward chunk ``f``, backward chunk ``b``, SI block ``si`` (<= f + b when overlap helps)."""
    for name, v in (("f", f), ("b", b), ("si", si)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    return lambda blk: {"F": f, "B": b, "SI": si}[blk.kind]
