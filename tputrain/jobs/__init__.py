"""Jobs run on a trained or training model, apart from the train loop.

Each takes a read-only view of a run (`tputrain.runtime.run_view.RunView`), not the
Trainer:

* `predict`: batch inference, every example's outputs once and in input order;
* `aggregation`: `Task.aggregate_eval`'s host-side metrics on predict's gathering
  pass over the eval set;
* `sidecar`: evaluating checkpoints apart from training (`tputrain eval`);
* `diagnose` and `advice`: where a step's time goes, and the knobs that fix it;
* `batch_finder` and `batch_report`: the largest per-replica batch that fits and pays;
* `vertex`: Vertex AI CustomJobs that train a gin config, validated offline.
"""
