"""Every private PyTorch API commfuse touches, in one place.

commfuse supports torch>=2.13,<2.14. Each name below is private (underscored or
undocumented) and may move between releases; when upgrading PyTorch, this is the
module to audit. Import these names from here, never directly.

Outside the package, the benchmark runner (a measurement tool, not library code)
also touches: `torch._inductor.utils.fresh_cache` (cold compile times),
`torch._inductor.compile_fx._recursive_post_grad_passes` (patched to time
commfuse's post-grad hook inside Inductor) and the profiler's `kineto_results`
(peak allocation). Audit `benchmarks/` with this module on upgrades.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

# Functional collectives: the ops Dynamo/AOTAutograd put in graphs for every
# c10d collective issued by DTensor or `torch.distributed._functional_collectives`.
c10d_functional = torch.ops._c10d_functional
# Autograd-aware variants (e.g. `all_to_all_single_autograd`); they appear in
# pre-dispatch graphs and are decomposed to `_c10d_functional` before partitioning.
c10d_functional_autograd = torch.ops._c10d_functional_autograd


def functional_overload(namespace, name: str, overload: str = "default"):
    """``namespace.name.overload`` where this torch release has it, else None.

    The functional point-to-point ops (`isend`, `irecv`, `batch_p2p_ops`) are newer than
    torch 2.11, which the lent GPU machine runs; registries skip what the release lacks."""
    packet = getattr(namespace, name, None)
    return None if packet is None else getattr(packet, overload, None)


def c10d_all_gather_single():
    """`torch.distributed.all_gather_single` (torch 2.13), else `all_gather_into_tensor`.

    Public in both releases, but 2.13 renamed it and deprecates the old name, while torch 2.11
    (the lent GPU machine's) has only the old one."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def c10d_reduce_scatter_single():
    """`torch.distributed.reduce_scatter_single` (torch 2.13), else `reduce_scatter_tensor`."""
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_process_group(group_name: str):
    """Map the string group name stored in a graph to a live ProcessGroup.

    Private: `torch.distributed.distributed_c10d._resolve_process_group`.
    Returns None when no process group of that name exists in this process
    (e.g. a graph loaded from disk), so callers degrade to "ranks unknown".
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(cast("GroupName", group_name))
    except (ValueError, RuntimeError, KeyError):
        return None


def register_process_group_alias(name: str, pg) -> None:
    """Make ``name`` resolve to ``pg`` in this process (replacing what it named before).

    Private: the process-group name registry of `torch._C._distributed_c10d`, through which
    functional collectives resolve a graph's group name."""
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

    _unregister_process_group(cast("GroupName", name))  # a no-op when the name is free
    _register_process_group(cast("GroupName", name), pg)


def fake_tensor_mode_of(gm: torch.fx.GraphModule):
    """The FakeTensorMode that produced `node.meta['val']` in this graph, if any.

    Private: `torch._guards.detect_fake_mode` (semi-public, underscored module).
    """
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def fake_tensor_mode_of_value(v):
    """The FakeTensorMode of a fake tensor; None for anything else (a real tensor).

    Private: `torch._subclasses.fake_tensor.FakeTensor`."""
    from torch._subclasses.fake_tensor import FakeTensor

    return v.fake_mode if isinstance(v, FakeTensor) else None


def active_fake_mode():
    """The fake mode active here (the tracing context's or the innermost on the mode stack), if any.

    Private: `torch._guards.detect_fake_mode`."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([])


def new_fake_mode():
    """A fresh FakeTensorMode with a shape environment: sizes read from tensor data become
    unbacked symbols, as under Dynamo.

    Private: `torch._subclasses.fake_tensor.FakeTensorMode`; semi-public `ShapeEnv`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def aot_autograd(**kwargs):
    """Private module path: `torch._dynamo.backends.common.aot_autograd`."""
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


def default_partition(*args, **kwargs):
    """Private: `torch._functorch.partitioners.default_partition` (what aot_eager uses)."""
    from torch._functorch.partitioners import default_partition as _dp

    return _dp(*args, **kwargs)


def make_boxed_func(fn):
    """Private: `torch._functorch.aot_autograd.make_boxed_func` (boxed calling convention)."""
    from torch._functorch.aot_autograd import make_boxed_func as _mbf

    return _mbf(fn)


def inductor_compile_fx(gm, example_inputs, **kwargs):
    """Private: `torch._inductor.compile_fx.compile_fx` (what backend='inductor' calls)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, **kwargs)


def inductor_compile_fx_inner(gm, example_inputs, **kwargs):
    """Inductor's compiler of one partitioned graph (private: `torch._inductor.compile_fx.compile_fx_inner`);
    commfuse's lowering compiles compute regions with it. Returns a boxed callable.
    Also private: `torch._guards.tracing`, `TracingContext`, `detect_fake_mode`."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    # Each region gets its own tracing context: Inductor records one graph's output strides
    # per context and asserts it records them once.
    with tracing(TracingContext(detect_fake_mode(example_inputs))):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def process_group_names() -> dict:
    """Private: `torch.distributed.distributed_c10d._world.pg_names` (every process group this
    process created -> its name)."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._world.pg_names


def process_group_with_members(ranks) -> "tuple[str, tuple[int, ...]] | None":
    """The name and group-rank order (global ranks) of a process group this process belongs to
    whose members are ``ranks`` (as a set): the default group if it is one, else the first such
    group created. Every member created it in the same collective call, so every member finds
    a group of that name (names come from creation order, the same on every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    want = set(int(r) for r in ranks)
    world = dist.group.WORLD
    assert world is not None  # initialized (checked above)
    if want == set(range(dist.get_world_size())):
        return world.group_name, tuple(range(dist.get_world_size()))
    for pg, name in process_group_names().items():
        if pg is world or pg is None:
            continue
        try:
            members = tuple(dist.get_process_group_ranks(pg))
        except (RuntimeError, ValueError):
            continue
        if set(members) == want and len(members) == len(want):
            return name, members
    return None


def device_mesh_root(mesh):
    """Private: the mesh a sliced DeviceMesh (``mesh["tp"]``) was cut from (itself if none)."""
    get = getattr(mesh, "_get_root_mesh", None)
    try:
        root = get() if get is not None else None
    except (RuntimeError, AttributeError):
        root = None
    return root if root is not None else mesh


def inductor_decompositions():
    """Private: `torch._inductor.decomposition.select_decomp_table()`, the decompositions
    AOTAutograd applies before Inductor sees a graph."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def dynamo_backend_registry():
    """Private: `torch._dynamo.backends.registry` (_COMPILER_FNS, register_backend)."""
    import torch._dynamo.backends.registry as reg

    return reg


def inductor_config():
    """Private: `torch._inductor.config` (pass hooks and comm-reordering switches)."""
    import torch._inductor.config as cfg

    return cfg


def inductor_mode_options(mode=None) -> dict:
    """Semi-public: `torch._inductor.list_mode_options` (the Inductor config each
    ``torch.compile(mode=...)`` sets; all modes by name when ``mode`` is None)."""
    from torch._inductor import list_mode_options

    return list_mode_options(mode)


def custom_graph_pass_base():
    """Semi-public: `torch._inductor.custom_graph_pass.CustomGraphPass` (cache-keyed hooks)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def reset_graph_namespace(graph) -> None:
    """Forget every name a Graph has handed out, so re-inserted nodes keep their names.

    Private: `torch.fx.graph._Namespace` and `Graph._graph_namespace`. Used only when
    restoring a graph in place after a failed pass.
    """
    from torch.fx.graph import _Namespace

    graph._graph_namespace = _Namespace()


def default_store():
    """The c10d Store of the default process group (used for the cross-rank agreement check).

    Private: `torch.distributed.distributed_c10d._get_default_store`.
    """
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def copy_graph(graph):
    """A node-for-node copy of an FX Graph (metadata copied shallowly), same codegen.

    Private: `Graph._tracer_cls`, `Graph._codegen` (the copy must generate the same
    calling convention, e.g. pytree in/out specs of make_fx graphs).
    """
    import torch.fx as fx

    copy = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    out = copy.graph_copy(graph, {})
    copy.output(out)
    copy._codegen = graph._codegen
    return copy


def register_work(tensor, work) -> None:
    """Tie an async c10d Work to a tensor so `_c10d_functional.wait_tensor(tensor)` waits on it
    (what the functional collectives do with their outputs).

    Private: `torch._C._distributed_c10d._register_work`. Used by commfuse's own async
    collective ops (`commfuse.ops.reduce_to_root.op`).
    """
    torch._C._distributed_c10d._register_work(tensor, work)


def extract_fwd_bwd_modules(
    joint: torch.fx.GraphModule, saved_values: list, saved_opaque: list, *, num_fwd_outputs: int
):
    """Split a joint graph into the forward that computes its forward outputs plus ``saved_values``
    and the backward that computes its gradient outputs from them and the tangents.

    Private: `torch._functorch.partitioners._extract_fwd_bwd_modules` (what every AOTAutograd
    partitioner ends with; commfuse's fused DHelix partition chooses the saved values itself).
    ``saved_opaque``: script objects (e.g. a DeviceMesh input) the backward passes through.

    Older releases (2.11, the GPU machine's) may lack the opaque-values argument and the switch that
    turns off the forward/backward placement check: each is passed only where this torch has it, and
    opaque values without the argument are an error naming the torch version."""
    import inspect

    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    params = inspect.signature(_extract_fwd_bwd_modules).parameters
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if "ignore_must_be_in_fw_bw" in params:
        kwargs["ignore_must_be_in_fw_bw"] = True
    if "saved_opaque_nodes" in params:
        return _extract_fwd_bwd_modules(joint, saved_values, [], saved_opaque, **kwargs)
    if saved_opaque:
        raise NotImplementedError(
            f"torch {torch.__version__}: _extract_fwd_bwd_modules cannot pass opaque values "
            f"({len(saved_opaque)}) from forward to backward"
        )
    return _extract_fwd_bwd_modules(joint, saved_values, [], **kwargs)


def is_tangent_placeholder(node: torch.fx.Node) -> bool:
    """AOTAutograd's naming of a joint graph's tangent inputs.

    Private: `torch._functorch.partitioners._is_tangent`."""
    from torch._functorch.partitioners import _is_tangent

    return _is_tangent(node)


def aot_input_is_parameter(node: torch.fx.Node) -> bool:
    """Whether AOTAutograd describes this graph input as a parameter or buffer (or a DTensor's
    local tensor of one): ``node.meta["desc"]``, an ``AOTInput`` descriptor.

    Private: `torch._functorch._aot_autograd.descriptors` (``ParamAOTInput``, ``BufferAOTInput``,
    ``SubclassGetAttrAOTInput.base``). Under torch.compile with inlined modules the parameters
    are plain inputs (``PlainAOTInput``): False then."""
    desc = node.meta.get("desc")
    while desc is not None:
        name = type(desc).__name__
        if name in ("ParamAOTInput", "BufferAOTInput"):
            return True
        desc = getattr(desc, "base", None) if name == "SubclassGetAttrAOTInput" else None
    return False


def funcol_autograd(name: str):
    """The differentiable functional collective ``name`` ("all_gather" or "reduce_scatter") of
    `torch.distributed._functional_collectives`, under the name this torch gives it.

    torch 2.13 names them ``*_single_autograd`` and deprecates the ``*_tensor_autograd`` names
    (same signature), which are the only ones older releases (2.11, the GPU machine's) have."""
    import torch.distributed._functional_collectives as funcol

    new, old = f"{name}_single_autograd", f"{name}_tensor_autograd"
    fn = getattr(funcol, new, None) or getattr(funcol, old, None)
    if fn is None:
        raise AttributeError(
            f"torch {torch.__version__} has neither {new} nor {old} in _functional_collectives"
        )
    return fn


# -- PyTorch's own observability: structured trace, TORCH_LOGS, profiler --------------------------


def structured_trace_enabled() -> bool:
    """Whether torch's structured trace (``TORCH_TRACE=dir``, or a handler a test installed on it)
    will write what commfuse emits: checked before building anything to emit.

    Private: `torch._logging._internal.trace_log` and `LazyTraceHandler`. Without TORCH_TRACE the
    lazy handler stays attached until the first event, where it finds no directory and removes
    itself; counting it as "on" would make commfuse's first artifact print a whole graph for
    nothing."""
    from torch._logging import _internal as tl

    for h in tl.trace_log.handlers:
        if not isinstance(h, tl.LazyTraceHandler) or h.root_dir is not None or h.stream is not None:
            return True
    return False


def trace_artifact(name: str, encoding: str, payload_fn) -> None:
    """One ``artifact`` event in torch's structured trace (what tlparse lists next to Dynamo's,
    AOTAutograd's and Inductor's), with ``payload_fn()`` evaluated only when the trace is on.
    ``encoding``: "string" (graph code, text) or "json".

    Private: `torch._logging.trace_structured` (underscored module; the call Inductor and
    AOTAutograd make). ``expect_trace_id=False``: commfuse's pipeline also runs outside a compile
    (offline on a graph), where torch would otherwise capture a Python stack for every event."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload_fn,
        expect_trace_id=False,
    )


def register_torch_logs(name: str) -> None:
    """Make ``name`` (the package logger) a log of torch's logging, so ``TORCH_LOGS=commfuse`` and
    ``torch._logging.set_logs(modules={"commfuse": logging.INFO})`` set its level and handler.

    Private: `torch._logging._internal.register_log` / `log_registry` (what
    `torch._logging._registrations` calls for torch's own logs). TORCH_LOGS is parsed when torch
    is imported, before commfuse is: torch then finds ``commfuse`` as an importable module,
    imports it (which registers this log) and enables it; registering again is a no-op."""
    from torch._logging import _internal as tl

    if not tl.log_registry.is_log(name):
        tl.register_log(name, [name])


def profiler_active() -> bool:
    """Whether a torch profiler is recording on this process (``torch.profiler.profile``, the
    autograd profiler, an on-demand trace): the runtime labels its work only then.

    Private: `torch._C._autograd._profiler_enabled` (one C call, the check record_function's
    users make; `torch.autograd.profiler._is_profiler_enabled` misses profilers started from C++)."""
    return torch._C._autograd._profiler_enabled()


def dynamo_frame() -> "Optional[tuple[str, str]]":
    """The frame Dynamo is compiling, as ``("dir/file.py:line:qualname", compile id)``; None outside a
    Dynamo compile. The path keeps its last two parts, so ranks whose checkouts sit in different
    directories name the frame alike.

    Private: `torch._guards.TracingContext.traced_code` (the root frame's code object first) and
    `torch._guards.CompileContext.current_compile_id`."""
    import os

    from torch._guards import CompileContext, TracingContext

    ctx = TracingContext.try_get()
    if ctx is None or not ctx.traced_code:
        return None
    code = ctx.traced_code[0]
    path = os.path.join(*os.path.normpath(code.co_filename).split(os.sep)[-2:])
    name = getattr(code, "co_qualname", code.co_name)
    return f"{path}:{code.co_firstlineno}:{name}", str(CompileContext.current_compile_id())


def eager_backward_compile(on: bool = True):
    """While active (and ``on``), AOTAutograd compiles a training graph's backward with its forward
    instead of at the first backward.

    Private: `torch._functorch.config.force_non_lazy_backward_lowering`."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(force_non_lazy_backward_lowering=True)
