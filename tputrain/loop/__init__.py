"""The compiled loop, in the order data flows through it.

* `inputs`: the host's datasets and iterators, and how a step's batches reach
  the replicas (host or distributed input mode);
* `step`: one optimizer step on one replica (accumulation, XLA);
* `host_loop`: many steps in one `tf.function` (fetch, input timing, stop);
* `replica_stats`: batch norm's moving statistics, one value on every replica
  after each loop;
* `evaluation`: the eval loop, agreed across hosts;
* `hosts`: what several hosts must agree on (topology, a MAX collective).

Beside the flow: `pipeline` and `update` (the optimizer's update, wrapping the user's
optimizer), `xla_plan` (what XLA compiles), `remat` (rematerialization),
`compile_cache` (XLA's persistent cache, enabled at `import tputrain`), and the
replica helpers (`replica_seeds`, `random_draws`, `batch_norm`, `convolutions`).
What runs while a step traces (lean tracing) is `tputrain.core.tracing`, below every
wing that traces.
"""
