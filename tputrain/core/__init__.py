"""The bottom wing: small helpers every other wing shares, importing no other wing.

* `checks`: the argument checks of the public constructors (one wording, one rule);
* `tracing`: lean tracing, what runs while a step traces (`once`, `graph_helper`,
  `user_call`), used by `data/`, `loop/`, `optim/`, `precision/`, the guard and
  the Task;
* `builders`: the builders a run calls when its caller passes none, which the gin
  registry (`tputrain.config.registry`) installs configured;
* `cache_dir`: the machine's cache folder (`TPUTRAIN_CACHE_DIR`), shared by the
  tasks' corpora, the FLOP peak probe and the plan trial.
* `cpu_info`: the CPU's model name and instruction-set flags, which key what those
  keep per kind of machine (and XLA's compile cache folder).

Each sat in the wing of its first user (`runtime/`, `loop/`, `config/`), which made
every lower wing that shares it import up; here each import of them runs down
(docs/architecture.md). A module belongs here only if it imports nothing of tputrain
and more than one wing needs it. The old paths still import, and warn
(`tputrain/_compat.py`).
"""
