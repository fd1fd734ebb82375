"""Actions: user code the Trainer calls at fixed points of a run.

Subclass `Action` and override what you need (as with Keras callbacks, Orbit
actions or Lightning callbacks), then pass instances to `Trainer(actions=[...])`.
The built-in profiler and non-finite policy are actions too, so a user action
sees the same points they do. Hooks run on every host, in the host process,
between compiled loops: keep them short, or do the work every Nth call.

One module an action (like Orbit's `orbit/actions/`): `base` (`Action`), `best`
(`BestCheckpoint`, and the `Watch` of one metric both it and `early_stopping` use),
`early_stopping` (`EarlyStopping`), `export` (`Export`, through
`tputrain.serving.export`), `init_checkpoint` (`InitCheckpoint`),
`config_summary` (the operative config in TensorBoard), `keras_callbacks`
(`KerasCallbacks`, with `keras_callback_state`), `mfu`, `profiler`, `nonfinite`,
`preemption`, `communication`. The names imported below are importable from
`tputrain.actions` as before; the others from their module (or `tputrain`).
"""

from tputrain.actions.base import Action, check_actions, checkpointed_states
from tputrain.actions.communication import CommunicationAction
from tputrain.actions.mfu import MFUAction, count_flops_per_step
from tputrain.actions.nonfinite import NonFinitePolicyAction
from tputrain.actions.preemption import PreemptionAction
from tputrain.actions.profiler import ProfilerAction

__all__ = ["Action", "CommunicationAction", "MFUAction", "NonFinitePolicyAction",
           "PreemptionAction", "ProfilerAction", "check_actions", "checkpointed_states",
           "count_flops_per_step"]
