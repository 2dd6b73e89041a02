"""The "auto" placement budget (training/engine_auto.py, ``placement_budget``): the reserve is a
fraction of the
memory this process can use, so a process left 24 GiB of a large GPU (another process holds the
rest) places into
the 24 GiB as it would on a 24 GiB card."""

from megatrain_ds.training.engine_auto import placement_budget

GiB = 2**30


def test_a_24_gib_card_and_24_gib_left_of_a_large_gpu_get_the_same_budget():
    # this process holds 10 GiB (slots, resident, activations) and the driver reports 14 GiB free
    card = placement_budget(
        free=14 * GiB, total=24 * GiB, held=10 * GiB, transient=GiB, reserve=0.1
    )
    shared = placement_budget(
        free=14 * GiB, total=141 * GiB, held=10 * GiB, transient=GiB, reserve=0.1
    )
    assert card == shared == int(14 * GiB - GiB - 2.4 * GiB)
    # a fraction of the whole GPU would have left nothing to place (14 - 1 - 14.1 < 0): the 10 GiB
    # of 24 seen
    assert 14 * GiB - GiB - 0.1 * 141 * GiB < 0


def test_the_whole_gpu_to_one_process_keeps_todays_budget():
    got = placement_budget(free=100 * GiB, total=141 * GiB, held=41 * GiB, transient=0, reserve=0.1)
    assert got == int(100 * GiB - 14.1 * GiB)


def test_a_transient_peak_is_left_free_and_a_negative_one_ignored():
    base = placement_budget(free=20 * GiB, total=24 * GiB, held=4 * GiB, transient=0, reserve=0.0)
    assert (
        placement_budget(
            free=20 * GiB, total=24 * GiB, held=4 * GiB, transient=3 * GiB, reserve=0.0
        )
        == base - 3 * GiB
    )
    assert (
        placement_budget(free=20 * GiB, total=24 * GiB, held=4 * GiB, transient=-GiB, reserve=0.0)
        == base
    )
