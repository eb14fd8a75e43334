"""Under torchrun (gloo, 3 processes): ranks 0-1 form one tensor-parallel group of the target at argv[1],
rank 2 stands outside it like a drafter rank. Each group rank compares its features with the whole
target's in one process, per tapped layer, on a padded batch; prints the largest relative difference."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from dflash_ddp.target import TargetFeatureExtractor, _layer_output, inspect_target
from dflash_ddp.tensor_parallel import group_meshes

dist.init_process_group("gloo")
rank = dist.get_rank()
info = inspect_target(sys.argv[1])
taps = [0, 2, info.num_layers - 1]  # the last one is final-normed
meshes = group_meshes(num_groups=1, tp_size=2, device_type="cpu")  # on every rank, the drafter's too
if rank < 2:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, info.vocab_size, (3, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # padding
    mask[2, 5:] = 0
    whole = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32)(ids, mask)
    sharded_model = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32, meshes)
    q = sharded_model.model.layers[0].self_attn.q_proj.weight
    local = q.to_local() if isinstance(q, DTensor) else q
    print(f"rank {rank}: q_proj holds {local.shape[0]} of {info.num_attention_heads * info.head_dim} rows")
    sharded = sharded_model(ids, mask)
    width = info.hidden_size
    for i, layer in enumerate(taps):
        a, b = sharded[..., i * width : (i + 1) * width], whole[..., i * width : (i + 1) * width]
        print(f"rank {rank}: layer {layer} relative difference {((a - b).norm() / b.norm()).item():.2e}")
    # a plan that left a layer's output sharded: the tap gathers it
    tp_mesh = meshes.get_mesh("tp")
    part = whole.chunk(2, dim=-1)[tp_mesh.get_local_rank()].contiguous()
    gathered = _layer_output((DTensor.from_local(part, tp_mesh, [Shard(2)]),))
    print(f"rank {rank}: sharded output gathered exactly: {torch.equal(gathered, whole)}")
dist.barrier()
dist.destroy_process_group()
