"""What keeps a run alive or stops it cleanly when something goes wrong.

* `guard`: `NonFiniteGuard`, NaN/Inf losses or gradients never reach the weights;
* `preemption`: on SIGTERM, stop at the next step boundary, checkpoint, exit 42;
* `preemption_early`: a SIGTERM before that is installed, held by the CLI's entry;
* `lock`: one run per model_dir, an exclusive lock held by the writing process.

Checkpoints that survive a crash live in `tputrain.checkpointing`; docs/fault_tolerance.md
is the guide.
"""
