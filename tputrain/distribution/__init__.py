"""Distribution: where a run's replicas and hosts come from and how they talk.

- `strategy`: the strategy resolver (TPU -> multi-worker -> mirrored -> CPU).
- `cluster`: TF_CONFIG, joining a multi-worker cluster, the join watchdog.
- `communication`: all-reduce options (`CommunicationOptions`) and their measures.
- `allreduce`: the gradient sum over replicas the update pipeline runs first.
- `launch`: `tputrain launch`, N local worker processes for multi-worker tests.
"""
