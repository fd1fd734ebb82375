"""Controller: the cadence of a run (loop boundaries, eval and save points)."""

import types

from tputrain.runtime.controller import Controller


def controller(**knobs):
    trainer = types.SimpleNamespace(steps_per_loop=100, train_steps=1000, checkpoint_every=250,
                                    eval_every=None, profile_steps=None)
    vars(trainer).update(knobs)
    return Controller(trainer, actions=[])


def test_loops_end_at_every_boundary():
    c = controller(eval_every=60)
    assert c.next_boundary(0) == 60  # eval before steps_per_loop
    assert c.next_boundary(200) == 40  # eval at 240
    assert c.next_boundary(240) == 10  # checkpoint at 250
    assert controller(profile_steps=(10, 15)).next_boundary(0) == 10  # trace starts on time
    assert controller(profile_steps=(10, 15)).next_boundary(10) == 5  # and stops on time


def test_a_train_num_steps_target_ends_the_loop_there():
    c = controller()
    c.until = 30
    assert c.next_boundary(0) == 30
    assert controller().next_boundary(990) == 10
