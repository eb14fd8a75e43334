"""Under torchrun (gloo, 3 processes): ranks 0-1 form one tensor-parallel group of each target given in
argv[2:], rank 2 stands outside it like a drafter rank. Each group rank compares its features with the
whole target's in one process, per tapped layer, on a padded batch, and writes what it found to
argv[1]/rank{r}.json (files, not stdout: the ranks' lines would interleave)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from dflash_ddp.parallel.meshes import group_meshes
from dflash_ddp.target_model.features import TargetFeatureExtractor, layer_output
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.quantization import NOT_QUANTIZED, truncated_weight_bytes
from dflash_ddp.target_model.tensor_parallel import unsharded_weight_bytes

dist.init_process_group("gloo")
rank = dist.get_rank()
meshes = group_meshes(num_groups=1, tp_size=2, device_type="cpu")  # on every rank, the drafter's too
found = {}
for target in sys.argv[2:] if rank < 2 else []:
    info = inspect_target(target)
    taps = [0, 2, info.num_layers - 1]  # the last one is final-normed
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, info.vocab_size, (3, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # padding
    mask[2, 5:] = 0
    whole, _ = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32)(ids, mask)
    sharded_model = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32, meshes)
    q = sharded_model.model.layers[0].self_attn.q_proj.weight
    local = sum(
        (w.to_local() if isinstance(w, DTensor) else w).numel() * w.element_size()
        for w in sharded_model.model.parameters()
    )
    layers = len(sharded_model.model.layers)
    total = truncated_weight_bytes(info, layers, NOT_QUANTIZED, torch.float32)
    whole_on_each = unsharded_weight_bytes(info, layers, NOT_QUANTIZED, torch.float32)
    sharded, _ = sharded_model(ids, mask)
    # soft targets: every layer and the LM head under the group's plan, against the whole target's
    _, whole_soft = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32, topk=4)(ids, mask)
    _, group_soft = TargetFeatureExtractor(info, taps, torch.device("cpu"), torch.float32, meshes, 4)(
        ids, mask
    )
    width = info.hidden_size
    differences = {}
    for i, layer in enumerate(taps):
        a, b = sharded[..., i * width : (i + 1) * width], whole[..., i * width : (i + 1) * width]
        differences[layer] = ((a - b).norm() / b.norm()).item()
    # a plan that left a layer's output sharded: the tap gathers it
    tp_mesh = meshes.get_mesh("tp")
    part = whole.chunk(2, dim=-1)[tp_mesh.get_local_rank()].contiguous()
    gathered = layer_output((DTensor.from_local(part, tp_mesh, [Shard(2)]),))
    found[target] = {
        "relative_differences": differences,
        "q_proj_rows": [(q.to_local() if isinstance(q, DTensor) else q).shape[0], q.shape[0]],
        "weight_bytes": {
            "local": local,
            "planned": (total - whole_on_each) // 2 + whole_on_each,
            "all": total,
        },
        "sharded_output_gathered_exactly": torch.equal(gathered, whole),
        "soft_top1_equal": torch.equal(group_soft.ids[..., 0], whole_soft.ids[..., 0]),
        "soft_probs_max_difference": (group_soft.probs.float() - whole_soft.probs.float()).abs().max().item(),
    }
if found:
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(found))
dist.barrier()
dist.destroy_process_group()
