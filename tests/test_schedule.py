"""The global batch sequence: the same for any split of the job, resumable at any batch.

That real jobs with 1, 2 and 3 target ranks train on the same batches is shown end to end in
test_distributed.py (bit-identical drafters; every drafter rank checks each batch against its schedule)."""

import random

from dflash_ddp.data.schedule import BatchSchedule, epoch_batches

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


def test_no_two_epochs_repeat_their_batches():
    epochs = [epoch_batches(LENGTHS, 1200, 5, e) for e in range(8)]
    compositions = [{tuple(sorted(b)) for b in batches} for batches in epochs]
    for e in range(1, 8):
        assert epochs[e] != epochs[e - 1]
        # the data set fits in one length-sorting window: the random first cut still moves the boundaries
        recurring = len(compositions[e] & compositions[e - 1]) / len(compositions[e])
        assert recurring < 0.2, f"epoch {e}: {recurring:.0%} of its batches also appear in epoch {e - 1}"


def test_padding_efficiency_on_a_chat_like_length_mix():
    rng = random.Random(0)
    lengths = [min(3072, max(32, int(rng.lognormvariate(6.4, 0.8)))) for _ in range(50_000)]
    batches = epoch_batches(lengths, 32768, 0, 0)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert sum(lengths) / padded >= 0.95
