"""Data-parallel training over every local device, with optional FSDP-style parameter sharding.

One mesh axis, "data": the batch is split along it; parameters are replicated, or with `fsdp`
each large array is split along its largest dimension that divides evenly. jit's sharding
propagation inserts the collectives, so the train step itself is written for one device.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from s3djax.errors import UserError

AXIS = "data"
_MIN_FSDP_SIZE = 2**14  # smaller arrays (norms, biases) are not worth splitting


def maybe_initialize_distributed() -> None:
    """Multi-host: join the job when the environment describes one (coordinator address or SLURM)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()


def make_mesh(devices=None) -> Mesh:
    return Mesh(np.asarray(devices or jax.devices()), (AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def param_sharding(mesh: Mesh, tree, fsdp: bool):
    n = mesh.size

    def spec(leaf):
        shape = np.shape(leaf)
        if not fsdp or n == 1 or np.prod(shape, dtype=np.int64) < _MIN_FSDP_SIZE:
            return NamedSharding(mesh, P())
        dims = [d for d in np.argsort(shape)[::-1] if shape[d] % n == 0]
        if not dims:
            return NamedSharding(mesh, P())
        axes = [None] * len(shape)
        axes[dims[0]] = AXIS
        return NamedSharding(mesh, P(*axes))

    return jax.tree.map(spec, tree)


def check_batch(batch_size: int, mesh: Mesh) -> None:
    if batch_size % mesh.size:
        raise UserError(f"batch_size {batch_size} does not split over {mesh.size} devices; use a multiple of {mesh.size}")


def global_batch(batch: dict, mesh: Mesh) -> dict:
    """This process's rows of the global batch -> arrays sharded over the mesh's data axis.

    Every process reads the same global batch (a pure function of the step) and contributes its slice.
    """
    sharding = batch_sharding(mesh)
    n, i = jax.process_count(), jax.process_index()

    def put(x):
        local = np.array_split(x, n)[i]
        return jax.make_array_from_process_local_data(sharding, local, x.shape)

    return jax.tree.map(put, batch)
