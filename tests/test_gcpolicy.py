"""``gcpolicy.fewer_collections`` raises the young threshold inside its block only."""

import gc

from autoshard.gcpolicy import YOUNG_THRESHOLD, fewer_collections


def test_the_threshold_is_raised_inside_and_put_back_after():
    old = gc.get_threshold()
    try:
        gc.set_threshold(700, 11, 12)
        with fewer_collections():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
            with fewer_collections():  # nested: the outer setting stands
                assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
        assert gc.get_threshold() == (700, 11, 12)
    finally:
        gc.set_threshold(*old)


def test_a_collector_switched_off_or_set_higher_is_left_alone():
    old = gc.get_threshold()
    try:
        for setting in ((0, 10, 10), (10 * YOUNG_THRESHOLD, 10, 10)):
            gc.set_threshold(*setting)
            with fewer_collections():
                assert gc.get_threshold() == setting
            assert gc.get_threshold() == setting
    finally:
        gc.set_threshold(*old)
