"""Trainer.close() and `with Trainer(...)`: each Trainer's iterators end at a known point."""

import gc
import weakref

import pytest

import tputrain
from tiny import TinyTask, strategy_for


def make(tmp_path, **kwargs):
    options = dict(train_steps=4, steps_per_loop=2, global_batch_size=16, checkpoint_every=4,
                   report_mfu=False)
    options.update(kwargs)
    return tputrain.Trainer(TinyTask(), str(tmp_path / "run"), strategy=strategy_for(1),
                            **options)


def test_close_releases_the_train_iterator_and_is_idempotent(tmp_path):
    trainer = make(tmp_path)
    trainer.train(num_steps=2)
    assert trainer.train_iterator is not None
    iterator = weakref.ref(trainer.train_iterator)
    trainer.close()
    assert trainer.train_iterator is None and trainer.closed
    gc.collect()
    assert iterator() is None  # nothing of the Trainer holds it: the resource is freed
    trainer.close()  # a second close does nothing
    assert trainer.closed


def test_train_and_evaluate_after_close_are_clear_errors(tmp_path):
    trainer = make(tmp_path)
    trainer.close()
    with pytest.raises(RuntimeError, match="closed"):
        trainer.train()
    with pytest.raises(RuntimeError, match="closed"):
        trainer.evaluate()


def test_predict_and_the_other_methods_after_close_are_clear_errors(tmp_path):
    """Every method that reads the run's iterators or checkpoints says it is closed."""
    trainer = make(tmp_path)
    trainer.close()
    for call in (trainer.predict, trainer.evaluate_weights, lambda: trainer.run_loop(1),
                 trainer.view):  # what export and the other jobs read
        with pytest.raises(RuntimeError, match="this Trainer is closed"):
            call()


def test_with_trainer_closes_it_on_exit(tmp_path):
    with make(tmp_path) as trainer:
        logs = trainer.train()
        assert not trainer.closed
    assert "loss" in logs
    assert trainer.closed and trainer.train_iterator is None


def test_with_trainer_closes_it_when_the_body_raises(tmp_path):
    with pytest.raises(KeyError):
        with make(tmp_path, input_mode="distributed") as trainer:
            trainer.train(num_steps=2)
            raise KeyError("user code failed")
    assert trainer.closed and trainer.train_iterator is None


def test_options_are_the_users_and_the_plan_the_resolved_ones(tmp_path):
    trainer = make(tmp_path)
    assert trainer.options.input_mode is None and trainer.input_mode == "host"
    assert trainer.plan.input_mode == "host" and trainer.plan.batch.per_replica == 16
    trainer.train_steps = 8  # a notebook raising the target: options re-validated
    assert trainer.options.train_steps == trainer.plan.train_steps == 8
    with pytest.raises(AttributeError, match="resolved"):
        trainer.input_mode = "distributed"
