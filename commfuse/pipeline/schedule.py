"""Pipeline schedules (GPipe, 1F1B) as per-stage action lists, and a check that one cannot deadlock.

Contract
- :func:`stage_actions` returns the ordered actions of one stage: ``F i`` runs the
  forward part of micro-batch i (receiving its activation from stage s-1 first, sending
  its output to stage s+1), ``B i`` its backward part (receiving the output gradient from
  s+1, sending the input gradient to s-1).
  * ``gpipe``: F 0..m-1, then B 0..m-1.
  * ``1f1b`` (PipeDream-Flush / Megatron): ``w = min(S-1-s, m)`` warm-up forwards, then
    m-w pairs (F w+k, B k), then the remaining backwards. At most ``w+1`` micro-batches
    of activations are alive on stage s (GPipe: m).
- Backward actions run in ascending micro-batch order in both schedules, so gradients
  are accumulated in the order of the plain accumulation loop.
- :func:`check_schedule` proves a schedule deadlock-free under the runtime's semantics
  and raises ``ValueError`` naming the first stuck stage otherwise. Semantics: sends are
  non-blocking (posted, waited at the end of the step), receives block; messages between
  a pair of ranks in one direction are matched in posting order (point-to-point, one
  tag); all ranks of a stage run the same actions (so collectives inside a stage match).
  Under these rules a rank can only wait for (a) a message of a neighbour action that
  has not run yet or (b) a peer of its own stage, which runs the same sequence. The check
  simulates the stages (each runs its next action once its receive is available) and
  also requires that each channel is received in the order it is sent (else the
  point-to-point matching would hand an action another micro-batch's data).
  Why 1F1B passes: stage s runs F i after stage s-1 ran F i (warm-up counts decrease by
  one per stage, so s-1 is always at least one forward ahead) and B i after stage s+1
  ran B i (s+1 reaches B i first: it has fewer warm-up forwards); with non-blocking sends
  nobody waits on a receiver.

Source: GPipe (Huang et al. 2019), PipeDream-Flush / 1F1B (Narayanan et al. 2021),
Megatron-LM's schedules; torch.distributed.pipelining ``Schedule1F1B`` (same order).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    phase: str  # "F" | "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}"


def _check_args(schedule: str, num_stages: int, stage: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")


def stage_actions(schedule: str, num_stages: int, stage: int, microbatches: int) -> list[Action]:
    """The ordered actions of ``stage`` (module docstring)."""
    _check_args(schedule, num_stages, stage, microbatches)
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    w = min(num_stages - 1 - stage, m)
    out = [Action("F", i) for i in range(w)]
    for k in range(m - w):
        out += [Action("F", w + k), Action("B", k)]
    out += [Action("B", i) for i in range(m - w, m)]
    return out


def check_schedule(orders: list[list[Action]]) -> list[list[str]]:
    """Simulate ``orders`` (one action list per stage); return the rounds (what ran when) or
    raise ValueError if a stage can never proceed or a channel would mismatch."""
    num = len(orders)
    done: list[set[tuple[str, int]]] = [set() for _ in range(num)]
    pos = [0] * num
    # FIFO channels: (sender, receiver) -> micro-batches sent and not yet received
    sent: dict[tuple[int, int], list[int]] = {}
    rounds: list[list[str]] = []

    def source(s: int, a: Action) -> int:
        return s - 1 if a.phase == "F" else s + 1

    def ready(s: int, a: Action) -> bool:
        if a.phase == "B" and ("F", a.microbatch) not in done[s]:
            raise ValueError(f"stage {s} runs B{a.microbatch} before F{a.microbatch}")
        peer = source(s, a)
        return not 0 <= peer < num or bool(sent.get((peer, s)))

    while any(pos[s] < len(orders[s]) for s in range(num)):
        # readiness on the state at the start of the round (stages act concurrently); only
        # stage s pops channel (peer, s), so applying the ready stages in turn is consistent
        runnable = [s for s in range(num) if pos[s] < len(orders[s]) and ready(s, orders[s][pos[s]])]
        if not runnable:
            stuck = [f"stage {s} waits at {orders[s][pos[s]]}" for s in range(num) if pos[s] < len(orders[s])]
            raise ValueError("schedule deadlocks: " + "; ".join(stuck))
        ran = []
        for s in runnable:
            a = orders[s][pos[s]]
            peer = source(s, a)
            if 0 <= peer < num:
                q = sent[(peer, s)]
                if q[0] != a.microbatch:
                    raise ValueError(
                        f"stage {s} runs {a} but the next message from stage {peer} is for "
                        f"micro-batch {q[0]}: point-to-point matching would mix micro-batches"
                    )
                q.pop(0)
            to = s + 1 if a.phase == "F" else s - 1
            if 0 <= to < num:
                sent.setdefault((s, to), []).append(a.microbatch)
            done[s].add((a.phase, a.microbatch))
            pos[s] += 1
            ran.append(f"s{s}:{a}")
        rounds.append(ran)
    for (a, b), q in sent.items():
        if q:
            raise ValueError(f"messages from stage {a} to stage {b} for micro-batches {q} are never received")
    return rounds


__all__ = ["Action", "SCHEDULES", "check_schedule", "stage_actions"]
