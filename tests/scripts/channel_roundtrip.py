"""Run under torchrun with 2 processes: rank 0 sends batches of varying shape with the target's features
(and, for each top-k of the comma-separated second argument, its soft targets), rank 1 receives them and compares every one with
its own forward of the same target, taking each one late (a slow drafter): the receiver holds at most its 2
messages ahead of training, and holds 2 at some point (it does not wait for training). Exit 0 if all match."""

import sys
import time

import torch
import torch.distributed as dist

from dflash_ddp.data.batch import Batch
from dflash_ddp.parallel.channel import ChannelReceiver, ChannelSender
from dflash_ddp.target_model.features import TargetFeatureExtractor
from dflash_ddp.target_model.info import inspect_target

SHAPES = [(1, 5), (3, 17), (2, 64), (5, 9), (1, 120), (4, 33)]  # (batch size, longest sequence)


def make_batch(g: int, batch_size: int, longest: int) -> Batch:
    gen = torch.Generator().manual_seed(g)
    lengths = torch.randint(1, longest + 1, (batch_size,), generator=gen)
    lengths[0] = longest
    attention = (torch.arange(longest)[None] < lengths[:, None]).long()
    ids = torch.randint(4, 250, (batch_size, longest), generator=gen) * attention
    loss = torch.randint(0, 2, (batch_size, longest), generator=gen) * attention
    return Batch(ids, attention, loss, torch.arange(batch_size) + 100 * g)


def main() -> int:
    dist.init_process_group("gloo")
    for topk in map(int, sys.argv[2].split(",") if len(sys.argv) > 2 else ["0"]):
        roundtrip(topk)
        dist.barrier()
    dist.destroy_process_group()
    return 0


def roundtrip(topk: int) -> None:
    """One sender's 6 messages to one receiver, with soft targets of `topk` (0: none)."""
    extractor = TargetFeatureExtractor(
        inspect_target(sys.argv[1]), [0, 2, 3], torch.device("cpu"), torch.float32, topk=topk
    )
    if dist.get_rank() == 0:
        sender = ChannelSender(0, max_inflight=2, device=torch.device("cpu"))
        for g, (b, s) in enumerate(SHAPES):
            batch = make_batch(g, b, s)
            features, soft = extractor(batch.input_ids, batch.attention_mask)
            sender.send(1, batch, features, g, g // 3, soft)
        sender.close([1])
    else:
        receiver = ChannelReceiver(
            1,
            [(g, 0) for g in range(len(SHAPES))],
            [0],
            torch.device("cpu"),
            torch.float32,
            torch.device("cpu"),
            max_buffered=2,
        )
        sizes = []
        for g, (b, s) in enumerate(SHAPES):
            time.sleep(0.2)  # training the previous batch
            message = receiver.get()
            sizes.append(message.received_bytes)
            expected = make_batch(g, b, s)
            assert message.g == g and message.epoch == g // 3
            for name in ("input_ids", "attention_mask", "loss_mask", "sample_ids"):
                assert torch.equal(getattr(message.batch, name), getattr(expected, name)), name
            own, soft = extractor(expected.input_ids, expected.attention_mask)
            assert torch.equal(message.features, own), f"batch {g}: features differ"
            if topk:
                assert torch.equal(message.soft.ids, soft.ids), f"batch {g}: soft target ids differ"
                assert torch.equal(message.soft.probs, soft.probs), (
                    f"batch {g}: soft target probabilities differ"
                )
            else:
                assert message.soft is None
        receiver.close()
        two_largest = sum(sorted(sizes)[-2:])
        assert max(sizes) < receiver.peak_bytes <= two_largest, (receiver.peak_bytes, sizes)
        print(f"all {len(SHAPES)} messages intact (top-{topk})")


if __name__ == "__main__":
    sys.exit(main())
