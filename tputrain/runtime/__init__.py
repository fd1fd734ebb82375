"""A run's machinery below the Trainer: what it decides once and what drives it.

* `plan`: `RunPlan`, the options resolved once against the strategy;
* `model_state`: the model and everything that updates it, built in strategy scope;
* `controller`: the cadence of a run (train loops, evals, checkpoints, actions);
* `context`: `ActionContext` and `ActionList`, what an action sees;
* `run_view`: `RunView`, the read-only view a job (`tputrain.jobs`) takes;
* `trainable_change` and `keras_clone`: a model whose trainable set changed (LoRA,
  freezing), and the user's Keras model rebuilt in the strategy scope;
* `preflight`, `validate`: what is checked before compute and the first write, in
  one line that names the fix (the argument checks every wing shares are
  `tputrain.core.checks`);
* `gcs`: the Cloud Storage operations `tf.io.gfile` lacks;
* `process_start`, `process_exit`: a process's start-up time, and a prompt exit.

`process_start`, `process_exit` import no TensorFlow (`import tputrain` runs them).
"""
