"""The shared vocabulary of NCCL logs and kernel traces: op names, datatypes, algorithms.

Sources (see docs/alignment.md, "Formats"):

* datatype and reduce-op codes: NCCL's ``ncclDataType_t`` / ``ncclRedOp_t`` enums
  (``nccl.h``; the NCCL-trace thesis, Tables 4.3 and 4.4, lists the same values);
* algorithm / protocol codes as the older ``"%ld Bytes -> Algo %d proto %d"`` tuning line
  prints them: ``NCCL_ALGO_TREE`` 0, ``RING`` 1, ``COLLNET_DIRECT`` 2, ``COLLNET_CHAIN`` 3,
  ``NVLS`` 4, ``NVLS_TREE`` 5, ``PAT`` 6; ``NCCL_PROTO_LL`` 0, ``LL128`` 1, ``SIMPLE`` 2;
  newer NCCL prints the names (``ncclAlgoToString``: ``Tree``, ``Ring``, ...), in either case;
* kernel datatype tokens: NCCL's ``src/device/generate.py`` (``f32``, ``bf16``, ``u32``...);
  signed integers share the unsigned kernel for sum/prod (its ``equivalent_primary``), so
  datatypes are compared in that normalised form (`kernel_dtype_class`).
"""

from __future__ import annotations

from typing import Optional

from commfuse.ir.kinds import CollectiveKind

# ncclDataType_t: code -> (name, bytes, kernel token)
NCCL_DATATYPES: dict[int, tuple[str, int, str]] = {
    0: ("int8", 1, "i8"),
    1: ("uint8", 1, "u8"),
    2: ("int32", 4, "i32"),
    3: ("uint32", 4, "u32"),
    4: ("int64", 8, "i64"),
    5: ("uint64", 8, "u64"),
    6: ("float16", 2, "f16"),
    7: ("float32", 4, "f32"),
    8: ("float64", 8, "f64"),
    9: ("bfloat16", 2, "bf16"),
    10: ("float8e4m3", 1, "f8e4m3"),
    11: ("float8e5m2", 1, "f8e5m2"),
}
NCCL_DATATYPE_CODES: dict[str, int] = {tok: code for code, (_, _, tok) in NCCL_DATATYPES.items()}

# ncclRedOp_t (codes >= 5 are user-created ops, e.g. PyTorch's PreMulSum for scaled averages)
NCCL_REDOPS: dict[int, str] = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}

ALGO_CODES = {
    0: "TREE",
    1: "RING",
    2: "COLLNET_DIRECT",
    3: "COLLNET_CHAIN",
    4: "NVLS",
    5: "NVLS_TREE",
    6: "PAT",
}
PROTO_CODES = {0: "LL", 1: "LL128", 2: "SIMPLE"}
_ALGO_NAMES = {
    "TREE": "TREE",
    "RING": "RING",
    "COLLNETDIRECT": "COLLNET_DIRECT",
    "COLLNET_DIRECT": "COLLNET_DIRECT",
    "COLLNETCHAIN": "COLLNET_CHAIN",
    "COLLNET_CHAIN": "COLLNET_CHAIN",
    "NVLS": "NVLS",
    "NVLSTREE": "NVLS_TREE",
    "NVLS_TREE": "NVLS_TREE",
    "PAT": "PAT",
}
_PROTO_NAMES = {"LL": "LL", "LL128": "LL128", "SIMPLE": "SIMPLE"}

# Kernel-name datatype tokens of every NCCL generation -> generate.py's token.
_DTYPE_TOKENS = {
    "i8": "i8",
    "u8": "u8",
    "i32": "i32",
    "u32": "u32",
    "i64": "i64",
    "u64": "u64",
    "f16": "f16",
    "f32": "f32",
    "f64": "f64",
    "bf16": "bf16",
    "f8e4m3": "f8e4m3",
    "f8e5m2": "f8e5m2",
    # NCCL <= 2.18 kernel names (ncclKernel_AllReduce_RING_LL_Sum_float)
    "int8_t": "i8",
    "uint8_t": "u8",
    "int32_t": "i32",
    "uint32_t": "u32",
    "int64_t": "i64",
    "uint64_t": "u64",
    "int8": "i8",
    "uint8": "u8",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
    "half": "f16",
    "float": "f32",
    "double": "f64",
    "__nv_bfloat16": "bf16",
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    # torch.profiler "dtype" metadata of NCCL kernels (c10 ScalarType names)
    "Float": "f32",
    "Half": "f16",
    "BFloat16": "bf16",
    "Double": "f64",
    "Byte": "u8",
    "Char": "i8",
    "Int": "i32",
    "Long": "i64",
    "Float8_e4m3fn": "f8e4m3",
    "Float8_e5m2": "f8e5m2",
}

# Canonical op names: NCCL's ncclFuncToString / kernel names.
COLLECTIVE_OPS = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce")
P2P_OPS = ("Send", "Recv", "SendRecv")
_OP_ALIASES = {o.lower(): o for o in COLLECTIVE_OPS + P2P_OPS}
_OP_ALIASES.update(
    {
        "allgatherv": "AllGather",
        "all_reduce": "AllReduce",
        "allreduce": "AllReduce",
        "all_gather": "AllGather",
        "all_gather_into_tensor": "AllGather",
        "_allgather_base": "AllGather",
        "reduce_scatter": "ReduceScatter",
        "reduce_scatter_tensor": "ReduceScatter",
        "_reduce_scatter_base": "ReduceScatter",
        "broadcast": "Broadcast",
        "reduce": "Reduce",
        "send": "Send",
        "recv": "Recv",
        "all_to_all": "SendRecv",
        "all_to_all_single": "SendRecv",
        "alltoall": "SendRecv",
        "alltoall_base": "SendRecv",
        "all_to_allv": "SendRecv",
    }
)


def canonical_op(name: Optional[str]) -> Optional[str]:
    """``allreduce`` / ``AllReduce`` / ``all_gather_into_tensor`` -> NCCL's op name; None if unknown."""
    if not name:
        return None
    return _OP_ALIASES.get(name.strip().lower())


def normalize_algo(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    s = name.strip()
    if s.isdigit():
        return ALGO_CODES.get(int(s))
    return _ALGO_NAMES.get(s.upper())


def normalize_proto(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    s = name.strip()
    if s.isdigit():
        return PROTO_CODES.get(int(s))
    return _PROTO_NAMES.get(s.upper())


def dtype_token(name: Optional[str]) -> Optional[str]:
    """A datatype as any source spells it -> generate.py's token (``f32``); None if unknown."""
    if name is None:
        return None
    return _DTYPE_TOKENS.get(name.strip())


def kernel_dtype_class(token: Optional[str]) -> Optional[str]:
    """Signed integers run in the unsigned kernel (generate.py ``equivalent_primary``)."""
    if token is None:
        return None
    return "u" + token[1:] if token.startswith("i") else token


def is_tree(algo: Optional[str]) -> Optional[bool]:
    """Kernel names only tell TREE from "not TREE" (generate.py maps every other algorithm to RING)."""
    return None if algo is None else algo == "TREE"


def collective_kind(op: str) -> Optional[CollectiveKind]:
    """NCCL op -> commfuse's kind (for bus factors); None for ops commfuse has no kind for."""
    return {
        "AllReduce": CollectiveKind.ALL_REDUCE,
        "AllGather": CollectiveKind.ALL_GATHER,
        "ReduceScatter": CollectiveKind.REDUCE_SCATTER,
        "Broadcast": CollectiveKind.BROADCAST,
        "Reduce": CollectiveKind.REDUCE,
        "Send": CollectiveKind.SEND,
        "Recv": CollectiveKind.RECV,
        "SendRecv": CollectiveKind.BATCH_P2P,
    }.get(op)


__all__ = [
    "ALGO_CODES",
    "COLLECTIVE_OPS",
    "NCCL_DATATYPES",
    "NCCL_DATATYPE_CODES",
    "NCCL_REDOPS",
    "P2P_OPS",
    "PROTO_CODES",
    "canonical_op",
    "collective_kind",
    "dtype_token",
    "is_tree",
    "kernel_dtype_class",
    "normalize_algo",
    "normalize_proto",
]
