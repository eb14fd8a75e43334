"""The global batch sequence: the same for any split of the job, resumable at any batch."""

import random

from dflash_ddp.schedule import BatchSchedule, epoch_batches

LENGTHS = [random.Random(i).randint(20, 300) for i in range(200)]


def test_a_range_of_batches_equals_the_same_slice_of_the_whole_sequence():
    schedule = BatchSchedule(LENGTHS, tokens_per_batch=1200, seed=5, batches_per_step=3, total_steps=60)
    everything = list(schedule)
    assert len(everything) == 180 and [b.g for b in everything] == list(range(180))
    assert len({b.epoch for b in everything}) > 2  # the run spans several epochs
    assert list(schedule.batches(37, 151)) == everything[37:151]
    assert list(schedule.batches(150, 250))[:30] == everything[150:180]  # past the planned end: more epochs


def test_each_epoch_reshuffles_and_is_reproducible():
    first, second = epoch_batches(LENGTHS, 1200, 5, 0), epoch_batches(LENGTHS, 1200, 5, 1)
    assert first == epoch_batches(LENGTHS, 1200, 5, 0)
    assert first != second
    assert sorted(i for b in first for i in b) == list(range(len(LENGTHS)))  # every sample once per epoch
    assert all(max(LENGTHS[i] for i in b) * len(b) <= 1200 for b in first)  # the padded-token budget holds
