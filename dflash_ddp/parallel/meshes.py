"""The device meshes of the target groups, as transformers' tensor- and expert-parallel loading takes them.

transformers builds one mesh over the whole world when it loads a model with a TP plan; a job of several
target groups (and drafter ranks beside them) gives each group its own, patched in while that group loads.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

# The mesh transformers expects (distributed/utils.py): dense layers on (pp, dp_replicate, fsdp, tp),
# experts on (pp, dp_replicate, efsdp, ep). The G groups are the replicas, the N ranks of a group both its
# tp and its ep axis: a mixture of experts' routed experts are spread over the group.
DENSE_DIMS = ("pp", "dp_replicate", "fsdp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep")


def group_meshes(num_groups: int, tp_size: int, device_type: str):
    """The device meshes of the target groups, built on every rank of the job (their process groups are
    created collectively); a rank outside the target ranks holds them without a coordinate. A group's ranks
    are its tensor-parallel ranks and, for a mixture of experts, its expert-parallel ones too (each holds a
    share of the experts: `ep` spans the group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.utils import TransformersDeviceMesh

    ranks = torch.arange(num_groups * tp_size).reshape(1, num_groups, 1, tp_size)
    dense = DeviceMesh(device_type, ranks, mesh_dim_names=DENSE_DIMS)
    experts = DeviceMesh(device_type, ranks, mesh_dim_names=EXPERT_DIMS)
    return TransformersDeviceMesh(dense, experts)


def tp_group(meshes):
    """This rank's tensor-parallel process group."""
    return meshes.get_mesh("tp").get_group()


@contextlib.contextmanager
def group_mesh(meshes, device: torch.device):
    """While loading: transformers takes `meshes` (this group's) instead of one over the whole world."""
    from transformers.distributed import mixin

    with mock.patch.object(mixin, "initialize_distributed_mesh", lambda _config: (device, meshes)):
        yield
