"""What a run shows: progress, time accounting, FLOPs and eval events.

* `progress`: one log line per loop and TensorBoard scalars in model_dir;
* `progress_bar`: a live bar where a person watches (terminal or Jupyter);
* `console`: progress on the console from Python, TensorFlow's start-up noise filtered;
* `goodput`: where a run's wall-clock time went, across restarts;
* `flops`: FLOPs per step and the device's peak (MFU);
* `eval_events`: the eval run's TensorBoard events;
* `summary_space`: a summary write that finds the disk full: one warning, the run goes on.

Nothing here decides what a run does: it only reports it.
"""
