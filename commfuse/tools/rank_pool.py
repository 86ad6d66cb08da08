"""A persistent pool of real gloo rank processes for multi-rank tests.

Starting a rank costs seconds (process spawn + ``import torch`` +
rendezvous), so the pool starts ``world_size`` workers once and reuses them
for every job of the pytest session::
    pool = get_pool(2)
    results = pool.run(my_module_level_fn, x, y)   # one value per rank, rank order

Contract of a job ``fn(*args, **kwargs)``:

* ``fn``, ``args``, ``kwargs`` and the return value are pickled with the
  standard pickler, so ``fn`` must be a module-level function importable in
  the worker (the worker mirrors the parent's ``sys.path`` before each job) and
  returned tensors should be plain CPU tensors (detach / ``.to_local()`` them).
* Inside ``fn`` the default process group is a gloo group of the pool's
  world size; use ``torch.distributed.get_rank()``.
* Before each job the worker calls ``torch._dynamo.reset()`` and destroys the
  non-default process groups (e.g. DeviceMesh subgroups) left by the previous
  job. Grad mode, default dtype and the thread count are restored after each
  job. RNG state is NOT reset: jobs seed themselves.
* A rank that raises makes :meth:`RankPool.run` raise :class:`RankFailure`
  (with every failing rank's remote traceback). A job that does not finish in
  time raises :class:`RankTimeout` and the pool is restarted, because a hung
  collective leaves the gloo group unusable. Either way the next job runs on a
  healthy pool.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# where `commfuse emulate` says each rank's network namespace is (netns.py's run_host)
from commfuse.emulate.netns import RANKS_ENV

__all__ = [
    "RankFailure",
    "RankPool",
    "RankPoolError",
    "RankTimeout",
    "RemoteError",
    "get_pool",
    "set_worker_initializer",
    "shutdown_all",
]

# After the first rank fails, how long the other ranks get to report before we
# assume they are stuck in a collective the failed rank never joined.
DEFAULT_FAILURE_GRACE_S = 3.0
# A healthy all_reduce takes milliseconds; anything close to this means the
# group is desynchronised.
_HEALTH_CHECK_TIMEOUT_S = 5.0
# How often a worker checks that its parent is still alive.
_PARENT_POLL_S = 1.0
# A worker holding more threads than this is replaced before the next job (RankPool.run).
MAX_WORKER_THREADS = 48
# _read's answer for "alive, nothing to read yet".
_NOTHING: tuple[Any, ...] = ("nothing",)
# What every worker spawned from now on runs once after joining its group (set_worker_initializer).
_WORKER_INITIALIZER: bytes | None = None


def set_worker_initializer(fn: Callable[[], Any] | None) -> None:
    """Make every rank process spawned from now on (by any pool of this process, restarts
    included) call ``fn()`` once, after it joined its gloo group and before its first job:
    settings a whole test session's ranks share, as multiprocessing.Pool's ``initializer``.
    ``fn`` must be picklable by reference (a module-level function); an exception in it is
    reported as the rank failing to start. None removes it. Pools already running keep what
    they were spawned with."""
    global _WORKER_INITIALIZER
    _WORKER_INITIALIZER = None if fn is None else pickle.dumps(fn)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RemoteError:
    """One rank's failure: exception type name, message and full traceback text."""

    rank: int
    exc_type: str
    message: str
    traceback: str


class RankPoolError(RuntimeError):
    """Base class of the errors raised by :class:`RankPool`."""


class RankFailure(RankPoolError):
    """At least one rank raised (or its process died) while running a job.

    Attributes:
        failures: rank -> :class:`RemoteError`, for every rank that failed.
        stuck_ranks: ranks that did not report within the grace period after
            the first failure (typically blocked in a collective).
        restarted: whether the pool was restarted to recover.
    """

    def __init__(
        self,
        job: str,
        world_size: int,
        failures: dict[int, RemoteError],
        stuck_ranks: Sequence[int] = (),
        restarted: bool = False,
    ) -> None:
        self.failures = dict(sorted(failures.items()))
        self.stuck_ranks = sorted(stuck_ranks)
        self.restarted = restarted
        super().__init__(self._format(job, world_size))

    def _format(self, job: str, world_size: int) -> str:
        lines = [f"{job}: {len(self.failures)} of {world_size} ranks failed (ranks {list(self.failures)})"]
        if self.stuck_ranks:
            lines.append(
                f"ranks {self.stuck_ranks} did not report after the failure "
                "(probably blocked in a collective)"
            )
        if self.restarted:
            lines.append("the rank pool was restarted")
        for rank, err in self.failures.items():
            lines.append(f"\n----- rank {rank}: {err.exc_type}: {err.message} -----")
            lines.append(err.traceback.rstrip())
        return "\n".join(lines)


class RankTimeout(RankPoolError):
    """A job did not finish within its timeout; the pool has been restarted.

    Attributes:
        missing_ranks: ranks that did not answer.
        finished_ranks: ranks that returned (or failed) in time.
        timeout_s: the timeout that expired.
    """

    def __init__(
        self,
        job: str,
        missing_ranks: Sequence[int],
        finished_ranks: Sequence[int],
        timeout_s: float,
    ) -> None:
        self.missing_ranks = sorted(missing_ranks)
        self.finished_ranks = sorted(finished_ranks)
        self.timeout_s = timeout_s
        super().__init__(
            f"{job} did not finish within {timeout_s:g} s: ranks {self.missing_ranks} "
            f"did not answer (ranks {self.finished_ranks} did). A rank that skips a "
            "collective the others run is the usual cause. The Python stacks of the "
            "hung ranks were dumped to their stderr; the rank pool was restarted."
        )


# --------------------------------------------------------------------------
# Worker side (runs in the spawned processes)
# --------------------------------------------------------------------------


def _watch_parent(parent_pid: int, store_dir: str) -> None:
    """Exit hard when the parent dies, even if the main thread is stuck in a
    collective (gloo waits release the GIL, so this thread keeps running)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            # A killed parent could not remove the store directory.
            shutil.rmtree(store_dir, ignore_errors=True)
            os._exit(1)


def _send(conn: multiprocessing.connection.Connection, msg: tuple[Any, ...]) -> None:
    # The standard pickler serialises tensors by value. Connection.send would
    # use torch's ForkingPickler reductions (shared memory + fd passing), which
    # ties the result's lifetime to the sender.
    conn.send_bytes(pickle.dumps(msg))


def _recv(conn: multiprocessing.connection.Connection) -> tuple[Any, ...]:
    return pickle.loads(conn.recv_bytes())


def _init_worker(rank: int, world_size: int, store_path: str, pg_timeout_s: float) -> None:
    """Configure torch for a test rank and join the gloo group."""
    if sys.platform == "linux" and os.path.exists("/sys/class/net/lo"):
        # All ranks live on this host; don't let gloo pick an external NIC.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # n ranks each with an inductor compile-worker pool would oversubscribe
    # the CPUs and cost seconds of start-up per rank; compile in-process.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )


def _sync_sys_path(parent_path: Sequence[str]) -> None:
    """Make modules importable in the parent (e.g. pytest's rootdir inserts)
    importable here, so job functions unpickle."""
    for entry in reversed(parent_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _destroy_subgroups() -> None:
    """Destroy process groups other than the default one.

    Jobs that build DeviceMeshes create gloo subgroups; each holds sockets and
    threads, so without this a long session exhausts them. This runs at the
    START of a job: every rank has then finished the previous job, so no peer
    still reads from these groups.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    for pg in list(c10d._world.pg_map):
        if pg is not default:
            dist.destroy_process_group(pg)


@contextlib.contextmanager
def _restored_global_state() -> Iterator[None]:
    """Undo the global torch settings a job is likely to change."""
    import torch

    grad_enabled = torch.is_grad_enabled()
    default_dtype = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_grad_enabled(grad_enabled)
        torch.set_default_dtype(default_dtype)
        torch.set_num_threads(1)


def _run_job(job_id: int, parent_path: Sequence[str], payload: bytes) -> tuple[Any, ...]:
    """Run one job; return the reply message (never raises)."""
    try:
        _sync_sys_path(parent_path)
        _destroy_subgroups()
        # Not imported yet means nothing to reset; importing dynamo costs ~1 s
        # per (re)started worker, which jobs that never compile shouldn't pay.
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()
        fn, args, kwargs = pickle.loads(payload)
        with _restored_global_state():
            value = fn(*args, **kwargs)
        try:
            data = pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"the job's return value ({type(value).__name__}) cannot be pickled back to the parent: {exc}"
            ) from exc
        return ("ok", job_id, data)
    # BaseException: pytest.fail/skip raise BaseException subclasses, and the
    # worker must survive anything the job throws.
    except BaseException as exc:  # noqa: BLE001
        return ("err", job_id, type(exc).__qualname__, str(exc), traceback.format_exc())


def _worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    pg_timeout_s: float,
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    initializer: bytes | None = None,
) -> None:
    """Entry point of a rank process: init once, then serve jobs until told to stop."""
    # Ctrl-C reaches the whole process group; the parent handles it by tearing
    # the pool down, ranks must not die half-way through a collective first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGUSR1"):
        # The parent sends SIGUSR1 to hung ranks to get their Python stacks.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(
        target=_watch_parent, args=(parent_pid, os.path.dirname(store_path)), daemon=True
    ).start()
    try:
        _init_worker(rank, world_size, store_path, pg_timeout_s)
        if initializer is not None:
            pickle.loads(initializer)()
    except BaseException as exc:  # noqa: BLE001
        _send(conn, ("init_err", rank, type(exc).__qualname__, str(exc), traceback.format_exc()))
        os._exit(1)
    _send(conn, ("ready", rank, os.getpid()))
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):  # the parent died (it would have sent "stop")
            shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
            break
        if msg[0] == "stop":
            break
        _, job_id, parent_path, payload = msg
        reply = _run_job(job_id, parent_path, payload)
        # Flush so the job's prints land in the output of the test that ran it.
        sys.stdout.flush()
        sys.stderr.flush()
        _send(conn, reply)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying gloo state while peers are gone
    # can block, and there is nothing to clean up.
    os._exit(0)


def _health_check() -> int:
    """Job used after a failure: an all_reduce proves the group is in sync."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if int(t.item()) != dist.get_world_size():
        raise RuntimeError(f"health check all_reduce gave {t.item()}")
    return dist.get_rank()


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _emulated_places(world_size: int) -> list[dict] | None:
    """Each rank's namespace under an emulated network, or None without one. A pool of another
    size than the emulated cluster cannot be placed on it: an error, not plain loopback."""
    raw = os.environ.get(RANKS_ENV)
    if not raw:
        return None
    places = sorted(json.loads(raw), key=lambda p: p["rank"])
    if len(places) != world_size:
        raise RankPoolError(
            f"a {world_size}-rank pool on an emulated network of {len(places)} ranks "
            f"({RANKS_ENV}): start the emulated cluster with {world_size} ranks"
        )
    return places


def _interpreter_in(place: dict, where: str) -> str:
    """An executable that runs this Python in the rank's network namespace, on its core, with
    gloo on its link (multiprocessing's spawn passes its arguments and descriptors through)."""
    path = os.path.join(where, f"python-rank{place['rank']}")
    pin = f"taskset -c {place['core']} " if place.get("core") is not None else ""
    with open(path, "w") as f:
        f.write(
            "#!/bin/sh\n"
            f"exec env GLOO_SOCKET_IFNAME={place['ifname']} {pin}"
            f'nsenter --net=/proc/{place["pid"]}/ns/net -- {shlex.quote(sys.executable)} "$@"\n'
        )
    os.chmod(path, 0o755)
    return path


def _job_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"job {module}.{name}"


@dataclasses.dataclass
class _Replies:
    values: dict[int, bytes] = dataclasses.field(default_factory=dict)
    errors: dict[int, RemoteError] = dataclasses.field(default_factory=dict)
    pending: set[int] = dataclasses.field(default_factory=set)
    died: bool = False  # a worker process exited


class RankPool:
    """``world_size`` gloo rank processes that run jobs on demand.

    Args:
        world_size: number of ranks.
        timeout_s: default per-job timeout, also the start-up timeout. The
            gloo group timeout is set to 90% of it so that a stuck collective
            eventually errors inside the rank too, but the pool's own timeout
            normally fires first (and restarts the pool).
        failure_grace_s: after a rank fails, how long the other ranks get to
            report before the pool assumes they are stuck and restarts.

    Jobs are serialised (one at a time; thread-safe). Processes are spawned
    immediately, but :meth:`run` only waits for them when first needed, so
    start-up overlaps with whatever the caller does in between.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout_s: float = 120.0,
        failure_grace_s: float = DEFAULT_FAILURE_GRACE_S,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.failure_grace_s = failure_grace_s
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._tmpdir: str | None = None
        self._ready = False
        self._next_job_id = 0
        self._generation = 0
        # times the workers were replaced because their threads piled up (not failures)
        self.recycled = 0
        self._closed = False
        self._start()

    # ---- public API -------------------------------------------------------

    @property
    def generation(self) -> int:
        """How many times the worker processes were started: once, plus each restart after a
        failure or a hang (replacing workers whose threads piled up is counted in ``recycled``)."""
        return self._generation

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the current workers, by rank."""
        return [p.pid for p in self._procs]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the values by rank.

        Raises:
            RankFailure: some rank raised or died (message holds each failing
                rank's remote traceback). The pool is usable afterwards.
            RankTimeout: not every rank answered within ``timeout`` (default:
                the pool's ``timeout_s``). The pool has been restarted.
            RankPoolError: the workers failed to start.
            pickle.PicklingError / AttributeError / TypeError: ``fn`` or its
                arguments cannot be pickled (raised here, before any rank runs).

        ``timeout`` is consumed by ``run``; pass a job argument of that name
        with ``functools.partial``.
        """
        job = _job_name(fn)
        payload = pickle.dumps((fn, args, kwargs))
        with self._lock:
            if self._closed:
                raise RankPoolError("the rank pool has been shut down")
            self._recycle_if_threads_piled_up()
            self._ensure_ready()
            generation = self._generation
            limit = self.timeout_s if timeout is None else timeout
            replies = self._dispatch(payload, limit)
            if replies.errors:
                self._recover_after_failure(replies)
                raise RankFailure(
                    job,
                    self.world_size,
                    replies.errors,
                    stuck_ranks=sorted(replies.pending),
                    restarted=self._generation != generation,
                )
            if replies.pending:
                self._dump_stacks(replies.pending)
                self._restart()
                raise RankTimeout(
                    job,
                    missing_ranks=sorted(replies.pending),
                    finished_ranks=sorted(replies.values),
                    timeout_s=limit,
                )
            return self._decode(job, replies.values)

    def restart(self) -> None:
        """Kill and respawn the workers (e.g. to reset process-global state)."""
        with self._lock:
            self._restart()

    def shutdown(self) -> None:
        """Stop the workers. Idempotent; the pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._teardown(graceful=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- lifecycle --------------------------------------------------------

    def _start(self) -> None:
        """Spawn the workers (does not wait for them to be ready)."""
        self._tmpdir = tempfile.mkdtemp(prefix=f"commfuse-rankpool-w{self.world_size}-")
        # A fresh FileStore per generation: no port races, no stale keys.
        store_path = os.path.join(self._tmpdir, "store")
        pg_timeout_s = max(1.0, 0.9 * self.timeout_s)
        self._procs, self._conns = [], []
        places = _emulated_places(self.world_size)
        for rank in range(self.world_size):
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    store_path,
                    pg_timeout_s,
                    child_conn,
                    os.getpid(),
                    _WORKER_INITIALIZER,
                ),
                name=f"commfuse-rank{rank}-of-{self.world_size}",
                daemon=True,  # multiprocessing's atexit terminates daemons
            )
            if places is None:
                proc.start()
            else:
                # spawn's interpreter is process-wide: this rank's, for this one start
                self._ctx.set_executable(_interpreter_in(places[rank], self._tmpdir))
                try:
                    proc.start()
                finally:
                    self._ctx.set_executable(sys.executable)
            child_conn.close()  # so EOF is seen when the worker dies
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._ready = False
        self._generation += 1

    def _ensure_ready(self) -> None:
        """Wait until every worker has joined the gloo group."""
        if self._ready:
            return
        if not self._procs:
            self._start()
        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(self.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._teardown(graceful=False)
                raise RankPoolError(
                    f"ranks {sorted(waiting)} of a {self.world_size}-rank pool did not "
                    f"start within {self.timeout_s:g} s"
                )
            for rank in self._wait(waiting, remaining):
                msg = self._read(rank)
                if msg is _NOTHING:
                    continue
                if msg is not None and msg[0] == "ready":
                    waiting.discard(rank)
                    continue
                self._teardown(graceful=False)
                if msg is not None and msg[0] == "init_err":
                    _, _, exc_type, message, tb = msg
                    detail = f"{exc_type}: {message}\n{tb}"
                else:
                    detail = "the process exited (see its stderr)"
                raise RankPoolError(f"rank {rank} failed to start:\n{detail}")
        self._ready = True

    def _restart(self) -> None:
        self._teardown(graceful=False)
        self._start()

    def _recycle_if_threads_piled_up(self) -> None:
        """Fresh workers when one holds more than ``MAX_WORKER_THREADS`` threads. A gloo
        process group keeps its threads after ``destroy_process_group`` (torch 2.13), so every
        job that builds a mesh leaves some; a worker of a long test session held 128, and such
        idle workers took 6% of a core each (the loops wake). Not a failure: ``generation``
        counts restarts after failures only."""
        if not self._ready or not sys.platform.startswith("linux"):
            return
        try:
            most = max(len(os.listdir(f"/proc/{p.pid}/task")) for p in self._procs)
        except OSError:  # a worker is gone: the next job finds out and restarts the pool
            return
        if most > MAX_WORKER_THREADS:
            self._teardown(graceful=True)
            self._start()
            self._generation -= 1
            self.recycled += 1

    def _teardown(self, *, graceful: bool) -> None:
        """Stop all workers and release their resources. Never blocks long."""
        if graceful:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    _send(conn, ("stop",))
            _join_all(self._procs, timeout_s=2.0)
        for proc in self._procs:
            if proc.is_alive():
                # SIGTERM kills even a rank blocked inside a gloo collective.
                proc.terminate()
        _join_all(self._procs, timeout_s=2.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._ready = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ---- job dispatch -----------------------------------------------------

    def _dispatch(self, payload: bytes, timeout_s: float) -> _Replies:
        """Send a job to every rank and collect replies until all ranks answer,
        the timeout expires, or the failure grace period after a failure ends."""
        job_id = self._next_job_id
        self._next_job_id += 1
        replies = _Replies(pending=set(range(self.world_size)))
        message = ("job", job_id, list(sys.path), payload)
        for conn in self._conns:
            try:
                _send(conn, message)
            except OSError:
                pass  # the worker is dead; its sentinel reports it below
        deadline = time.monotonic() + timeout_s
        grace_deadline: float | None = None
        try:
            while replies.pending:
                limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    break
                for rank in self._wait(replies.pending, remaining):
                    self._collect_one(rank, job_id, replies)
                if replies.errors and grace_deadline is None:
                    grace_deadline = time.monotonic() + self.failure_grace_s
        except BaseException:
            # e.g. KeyboardInterrupt: ranks are mid-job and pytest is probably
            # exiting; kill them now, the next run() starts fresh ones.
            self._teardown(graceful=False)
            raise
        return replies

    def _collect_one(self, rank: int, job_id: int, replies: _Replies) -> None:
        msg = self._read(rank)
        if msg is _NOTHING:
            return
        if msg is None:
            replies.died = True
            proc = self._procs[rank]
            proc.join(timeout=1.0)
            replies.errors[rank] = RemoteError(
                rank,
                "ProcessDied",
                f"rank {rank} process exited with code {proc.exitcode}",
                f"rank {rank} process (pid {proc.pid}) exited with code {proc.exitcode} "
                "while running the job; see its stderr above.\n",
            )
        elif msg[1] != job_id:
            return  # stale reply of an abandoned job; keep waiting
        elif msg[0] == "ok":
            replies.values[rank] = msg[2]
        else:
            _, _, exc_type, message, tb = msg
            replies.errors[rank] = RemoteError(rank, exc_type, message, tb)
        replies.pending.discard(rank)

    def _wait(self, ranks: set[int], timeout_s: float) -> list[int]:
        """Ranks among ``ranks`` that have a message or whose process exited."""
        by_handle: dict[Any, int] = {}
        for rank in ranks:
            by_handle[self._conns[rank]] = rank
            by_handle[self._procs[rank].sentinel] = rank
        ready = multiprocessing.connection.wait(list(by_handle), timeout=timeout_s)
        return sorted({by_handle[h] for h in ready})

    def _read(self, rank: int) -> tuple[Any, ...] | None:
        """Next message from ``rank``; None if its process is gone; ``_NOTHING``
        if it is alive with nothing to read.

        A worker may exit right after replying, so a readable pipe wins over
        an exited sentinel."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                return _recv(conn)
        except (EOFError, OSError):
            return None
        return _NOTHING if self._procs[rank].is_alive() else None

    def _recover_after_failure(self, replies: _Replies) -> None:
        """Leave the pool usable after a job in which some rank failed."""
        if replies.pending or replies.died:
            # Stuck ranks never return; a dead rank breaks the group.
            self._restart()
            return
        # Every rank returned, but one that raised may have skipped collectives
        # the others ran into a gloo timeout, or issued a different number of
        # them: a desynchronised group hangs or corrupts later jobs. One
        # all_reduce tells us.
        try:
            self._health_check()
        except RankPoolError:
            self._restart()

    def _health_check(self) -> None:
        replies = self._dispatch(pickle.dumps((_health_check, (), {})), _HEALTH_CHECK_TIMEOUT_S)
        if replies.errors or replies.pending:
            raise RankPoolError("rank pool health check failed")

    def _dump_stacks(self, ranks: set[int]) -> None:
        """Ask hung ranks to print their Python stacks (to their stderr)."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for rank in ranks:
            pid = self._procs[rank].pid
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(0.3)  # let faulthandler write before we kill them

    def _decode(self, job: str, values: dict[int, bytes]) -> list[Any]:
        out: list[Any] = []
        for rank in range(self.world_size):
            try:
                out.append(pickle.loads(values[rank]))
            except Exception as exc:
                err = RemoteError(
                    rank,
                    type(exc).__qualname__,
                    f"the parent could not unpickle rank {rank}'s return value: {exc}",
                    traceback.format_exc(),
                )
                raise RankFailure(job, self.world_size, {rank: err}) from exc
        return out


def _join_all(procs: Sequence[multiprocessing.process.BaseProcess], timeout_s: float) -> None:
    """Join processes with one shared deadline."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------
# Session-wide pools
# --------------------------------------------------------------------------

_POOLS: dict[int, RankPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(world_size: int) -> RankPool:
    """The process-wide pool of ``world_size`` ranks, created on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None or pool._closed:
            pool = _POOLS[world_size] = RankPool(world_size)
        return pool


def shutdown_all() -> None:
    """Stop every pool created by :func:`get_pool` (registered with atexit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown()


atexit.register(shutdown_all)
