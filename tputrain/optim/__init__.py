"""Optimizers and what changes the weights beside them.

* `optimizers`: `build_optimizer`, the default `Task.build_optimizer` (gin-configured
  through `tputrain.config.registry`);
* `lars`: `LARS`, SGD with momentum and a layer-wise trust ratio;
* `schedules`: learning-rate warmup then decay, and `scale_learning_rate`;
* `ema`: `ExponentialAverage` weights (`Trainer.ema_decay`), and Keras's own
  `use_ema` averages put into the model at the end of `tputrain.fit`.

How an optimizer is applied inside a step (accumulation, all-reduce, the guard) is
`tputrain.loop.pipeline` and `tputrain.loop.update`.
"""
