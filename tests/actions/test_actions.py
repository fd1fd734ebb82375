"""Actions: user code called after each loop, evaluation and save, and at the end."""

import pytest

import tputrain
from tiny import TinyTask, strategy_for


class Recorder(tputrain.Action):
    def __init__(self):
        self.calls = []

    def on_loop_end(self, trainer, step, logs):
        self.calls.append(("loop", step, dict(logs)))

    def on_eval_end(self, trainer, step, logs):
        self.calls.append(("eval", step, dict(logs)))

    def on_save(self, trainer, step, path):
        self.calls.append(("save", step, path))

    def on_train_end(self, trainer, step, logs):
        self.calls.append(("end", step, dict(logs)))


def make(tmp_path, actions, **kwargs):
    options = dict(train_steps=6, steps_per_loop=2, global_batch_size=16, checkpoint_every=4,
                   eval_every=4, eval_steps=2, report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(TinyTask(), str(tmp_path / "run"), strategy=strategy_for(2),
                            actions=actions, **options)


def test_a_user_action_sees_every_loop_eval_save_and_the_end(tmp_path):
    recorder = Recorder()
    final = make(tmp_path, [recorder]).train()
    kinds = [(kind, step) for kind, step, _ in recorder.calls]
    assert kinds == [("loop", 2), ("loop", 4), ("eval", 4), ("save", 4), ("loop", 6),
                     ("save", 6), ("eval", 6), ("end", 6)]
    loops = [logs for kind, _, logs in recorder.calls if kind == "loop"]
    for logs in loops:  # the loop's own numbers, not only the loss
        assert {"loss", "accuracy", "learning_rate", "steps_per_second"} <= set(logs)
    assert len({logs["loss"] for logs in loops}) == 3
    saves = [path for kind, _, path in recorder.calls if kind == "save"]
    assert saves[0].endswith("ckpt-4") and saves[1].endswith("ckpt-6")
    assert recorder.calls[-1][2] == final


def test_train_num_steps_trains_that_many_more(tmp_path):
    recorder = Recorder()
    trainer = make(tmp_path, [recorder], train_steps=100)
    trainer.train(num_steps=2)
    assert trainer.current_step == 2
    trainer.train(num_steps=4)
    assert trainer.current_step == 6
    with pytest.raises(ValueError, match="num_steps"):
        trainer.train(num_steps=0)


def test_actions_must_be_actions(tmp_path):
    with pytest.raises(TypeError, match="tputrain.Action"):
        make(tmp_path, [lambda *args: None])
