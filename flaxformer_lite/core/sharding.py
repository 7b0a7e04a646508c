"""One device mesh, logical axis rules, and sharded initialisation.

The mesh has three axes: "data" (batch split, parameters replicated), "fsdp" (batch split and
parameters sharded over their "embed" axis, gathered per layer by XLA) and "tensor" (heads, MLP
hidden units and vocabulary split: Megatron-style tensor parallelism). Layers name their
parameter axes ("embed", "heads", "kv", "mlp", "vocab"); ``LOGICAL_RULES`` maps those names to
mesh axes, so changing the parallelism never touches a layer. The stacked parameters of a
``scan_layers`` model have a leading "layers" axis, replicated: each device holds its shard of
every layer, as in the unrolled model.

Rules are tried in order, and a rule applies to a dimension only when its mesh axes are still
free in that tensor and divide the dimension; otherwise the next rule for that name is tried
(none left: the dimension is replicated). So key/value projections ("kv_embed", "kv_heads")
split their heads over "tensor" when they can and their input axis otherwise (multi-query and
few kv heads). ``check_attention_fits_mesh`` rejects a model whose attention cannot be split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    # Parameters.
    ("embed", "fsdp"),
    ("heads", "tensor"),
    # Key/value projections: heads over tensor when it divides them, else the input (d_model)
    # axis over tensor too (row-parallel: partial products summed by one all-reduce).
    ("kv_heads", "tensor"),
    ("kv_embed", ("fsdp", "tensor")),
    ("kv_embed", "fsdp"),
    ("kv_embed", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("layers", None),  # scan_layers: the stacked layer axis
    # Mixture-of-experts weights `[experts, ...]`: expert parallelism over the data axis (each
    # data-parallel group of devices holds its experts; GSPMD moves tokens to them), replicated
    # when the data degree does not divide the number of experts.
    ("expert", "data"),
    # Activations: the batch is split over data and fsdp; the residual stream is whole on
    # every tensor-parallel device (Megatron), heads/mlp split inside the sub-layers.
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
)


def mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Resolves one -1 entry to fill the devices; checks the product equals ``num_devices``."""
    shape = [int(s) for s in shape]
    if len(shape) != len(MESH_AXES):
        raise ValueError(f"mesh_shape must have {len(MESH_AXES)} entries {MESH_AXES}; got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh_shape entries must be positive, with at most one -1; got {shape}")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh_shape {shape} cannot fill {num_devices} devices")
        shape[shape.index(-1)] = num_devices // known
    if int(np.prod(shape)) != num_devices:
        raise ValueError(
            f"mesh_shape {shape} uses {int(np.prod(shape))} devices but {num_devices} are present"
        )
    return tuple(shape)


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes ("data", "fsdp", "tensor") over all devices (or the given ones)."""
    devices = jax.devices() if devices is None else list(devices)
    resolved = mesh_shape(shape, len(devices))
    try:
        grid = mesh_utils.create_device_mesh(resolved, devices=devices)
    except Exception:  # noqa: BLE001 - CPU and odd topologies: a plain reshape is fine
        grid = np.asarray(devices).reshape(resolved)
    return Mesh(grid, MESH_AXES)


# The mesh axes a batch is split over.
BATCH_AXES = ("data", "fsdp")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the data and fsdp axes; the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def batch_parallelism(mesh: Mesh) -> int:
    """Devices a batch is split over (data x fsdp): batch rows must be a multiple of it."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def cache_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """Where one entry of a decoding key/value cache lives.

    Keys and values `[batch, kv_heads, length, head_dim]` (stored heads first,
    ``ops.kv_cache.heads_first``) put the batch on data x fsdp and the kv heads on tensor, each
    only where the mesh axis divides the dimension (multi-query attention's single kv head stays
    whole on every tensor-parallel device). Another entry has its leading axis split like a
    batch when that divides; scalars (``cache_index``) are replicated.
    """
    spec: list[Any] = [None] * len(shape)
    if len(shape) >= 1 and shape[0] % batch_parallelism(mesh) == 0:
        spec[0] = BATCH_AXES
    if len(shape) == 4 and shape[1] % mesh.shape["tensor"] == 0:
        spec[1] = "tensor"
    return NamedSharding(mesh, PartitionSpec(*spec))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """:func:`cache_sharding` for every array of a cache tree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map(lambda x: cache_sharding(x.shape, mesh), cache)


def logical_to_spec(
    names: Sequence[str | None], shape: Sequence[int], mesh_sizes: Any, rules=LOGICAL_RULES
) -> PartitionSpec:
    """The PartitionSpec of one tensor from its logical axis names and shape.

    Rules are tried in order; ``(name, mesh_axes)`` is taken by the first dimension called
    ``name`` that no earlier rule placed, if none of ``mesh_axes`` is used by another dimension
    of this tensor and their total size divides that dimension (``mesh_axes`` None: replicated,
    and the name is settled). Dimensions no rule places are replicated.
    """
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} logical axis names {tuple(names)} for shape {shape}")
    spec: list[Any] = [None] * len(names)
    placed = [False] * len(names)
    used: set[str] = set()
    for name, mesh_axes in rules:
        for pos, dim_name in enumerate(names):
            if dim_name != name or placed[pos]:
                continue
            axes = () if mesh_axes is None else tuple(np.atleast_1d(mesh_axes).tolist())
            size = int(np.prod([mesh_sizes[a] for a in axes])) if axes else 1
            if used & set(axes) or shape[pos] % size:
                break  # this rule cannot place it; a later rule for the name may
            spec[pos], placed[pos] = mesh_axes, True
            used.update(axes)
            break
    return PartitionSpec(*spec)


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
    """NamedShardings for a tree whose leaves may be ``nn.LogicallyPartitioned`` boxes
    (``logical_to_spec`` of each box's names and shape).

    Unboxed leaves (step counters, RNG keys, optimizer counts) are replicated. A box around
    an empty subtree (``optax.MaskedNode``: no optimizer state for a frozen parameter) stays
    that empty subtree.
    """

    def one(leaf: Any) -> Any:
        if isinstance(leaf, nn.Partitioned) and not hasattr(leaf.value, "shape"):
            return leaf.value
        if isinstance(leaf, nn.Partitioned):
            spec = logical_to_spec(leaf.names, leaf.value.shape, mesh.shape, rules)
            return NamedSharding(mesh, spec)
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map(
        one, abstract_tree, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def check_attention_fits_mesh(config: Any, mesh: Mesh | dict[str, int]) -> None:
    """Fails, naming the field, when tensor parallelism cannot split every attention kernel of
    ``config`` (a TransformerConfig) over ``mesh``'s "tensor" axis. Query heads (and the output
    projection) split over it; key/value kernels split their kv heads, or else d_model (which
    divides when d_model = num_heads * head_dim, but need not with ``head_dim`` set apart).
    Call it where the mesh meets the config (train.py does, before initialising)."""
    tensor = int(dict(mesh.shape if isinstance(mesh, Mesh) else mesh).get("tensor", 1))
    if tensor > 1 and config.num_heads % tensor:
        raise ValueError(
            f"TransformerConfig.num_heads ({config.num_heads}) must be divisible by the tensor-"
            f"parallel degree {tensor} (mesh_shape's third entry) to split attention heads; "
            "change num_heads or mesh_shape"
        )
    if tensor > 1 and config.kv_heads % tensor and config.d_model % tensor:
        raise ValueError(
            f"TransformerConfig.d_model ({config.d_model}) must be divisible by the tensor-"
            f"parallel degree {tensor} when its {config.kv_heads} key/value head(s) are not: "
            "the key/value kernels then split d_model (set with head_dim apart from "
            "d_model / num_heads); change d_model, head_dim, num_kv_heads or mesh_shape"
        )


def sharded_init(init_fn: Callable[[], Any], mesh: Mesh, rules=LOGICAL_RULES) -> tuple[Any, Any]:
    """Runs ``init_fn`` (which returns a tree of boxed parameters/state) directly into shards.

    The tree is traced with ``jax.eval_shape`` (no memory), its logical names turned into
    NamedShardings, and a jitted init with those ``out_shardings`` materialises each shard on
    its own device: a model larger than one device never exists whole anywhere.

    Returns:
      (unboxed state, its shardings tree).
    """
    abstract = jax.eval_shape(init_fn)
    shardings = logical_shardings(abstract, mesh, rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: nn.meta.unbox(init_fn()), out_shardings=shardings)()
    return state, shardings


def process_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's contiguous rows of a global batch (rows divisible by process count).

    Which rows of the global array they become depends on where the mesh puts this
    process's devices (not necessarily rows ``[p*R/P, (p+1)*R/P)``): fine for sums (loss),
    and :func:`global_rows_with_ids` / :func:`gather_in_row_order` recover the order where it
    matters."""
    index, count = jax.process_index(), jax.process_count()
    out = {}
    for key, value in batch.items():
        rows = value.shape[0]
        if rows % count:
            raise ValueError(f"batch rows ({rows}) must be divisible by process_count ({count})")
        per = rows // count
        out[key] = value[index * per : (index + 1) * per]
    return out


def use_cpu_devices(count: int) -> bool:
    """Splits the host's CPU into ``count`` XLA devices (``jax_num_cpu_devices``, what
    ``--xla_force_host_platform_device_count`` sets), if JAX has not started its backends yet:
    a mesh over every device then data-parallelises the batch over them, each device running
    its share of every step on its own thread. On 2 cores, 2 devices train the Multi30k model
    about 1.16x as fast as one device whose ops split over both cores (bench/cpu_devices.py).
    Only the CPU platform changes; a run on GPUs or TPUs still uses those.

    Returns whether the host now has ``count`` CPU devices: False (and nothing changes) when
    the backends already started with another count; the setting must come before the first
    JAX computation (train.py applies it first).
    """
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backends already started
        return len(jax.devices("cpu")) == count
    return True


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> None:
    """Joins a multi-process run (several hosts, or several processes on one host).

    With ``auto`` (TPU VM pod slices, SLURM, ...) JAX finds the coordinator itself; otherwise
    the three values come from the arguments. CPU processes talk through gloo collectives.
    Does nothing for a single process.
    """
    if not auto and not (num_processes and num_processes > 1):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:
        jax.distributed.initialize()
    else:
        if coordinator_address is None or process_id is None:
            raise ValueError(
                "num_processes > 1 needs coordinator_address (host:port) and process_id"
            )
        jax.distributed.initialize(coordinator_address, num_processes, process_id)


def host_local_to_global(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Each process passes its rows of the global batch; returns global sharded arrays."""
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
    }


ROW_ID = "row_id"


def global_rows_with_ids(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """:func:`host_local_to_global` of this process's rows of ``batch``, plus ``row_id``
    int32 [rows]: the index of each row in ``batch``, carried along whichever global rows the
    mesh's device order assigns to this process."""
    rows = len(next(iter(batch.values())))
    ids = np.arange(rows, dtype=np.int32)
    return host_local_to_global(process_rows({**batch, ROW_ID: ids}), mesh)


def gather_in_row_order(values: jax.Array, row_ids: jax.Array) -> np.ndarray:
    """``values`` [rows, ...] gathered to every process, row ``i`` the one whose ``row_ids``
    is ``i``: the order of the original batch for any device-to-process layout.

    ``values`` must have been computed row by row from a batch of
    :func:`global_rows_with_ids` (row ``j`` of ``values`` belongs to ``row_ids[j]``).
    """
    from jax.experimental import multihost_utils

    values, row_ids = multihost_utils.process_allgather((values, row_ids), tiled=True)
    values, row_ids = np.asarray(values), np.asarray(row_ids)
    if sorted(row_ids.tolist()) != list(range(len(row_ids))):
        raise ValueError(f"row_ids are not a permutation of 0..{len(row_ids) - 1}")
    out = np.empty_like(values)
    out[row_ids] = values
    return out
