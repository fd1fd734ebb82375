"""`Sender`: a tracker's calls on a background thread, so a tracker that is down or
slow never stops or slows training.

The hooks put jobs on a bounded queue and return at once. One thread sends them in
order; a job that fails (the server is down, a timeout) is retried after a pause
that doubles up to `MAX_PAUSE`, and the first failure is logged once (and the
recovery once). A full queue drops the newest job and says so once: the metrics
of a run whose tracker stays down are lost beyond the queue, the training is not.
`flush(timeout)` waits, at most that long, for the queue to empty (the end of a
run); `close()` stops the thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from absl import logging

MAX_PAUSE = 30.0  # seconds between retries of a failing job, at most
FIRST_PAUSE = 0.5


class Sender:
    """Runs `send(job)` for each job put, in order, on one daemon thread."""

    def __init__(self, name: str, send: Callable[[Any], None], max_jobs: int = 1000):
        self.name, self._send = name, send
        self._queue: queue.Queue = queue.Queue(maxsize=max_jobs)
        self._stop = threading.Event()
        self.failing, self.dropped, self.sent = False, 0, 0
        self._thread = threading.Thread(target=self._run, name=f"tputrain-{name}",
                                        daemon=True)
        self._thread.start()

    def put(self, job: Any) -> None:
        """Queues `job`; never blocks (a full queue drops it, said once)."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            if not self.dropped:
                logging.warning("tputrain: %s: %d jobs queued and the tracker is not taking "
                                "them: later metrics are dropped (training goes on)",
                                self.name, self._queue.maxsize)
            self.dropped += 1

    def flush(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for every queued job to be sent; True if so."""
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True)
        waiter.start()
        if not done.wait(timeout):
            # Down: its warning was the one line; slow: this is.
            log = logging.info if self.failing else logging.warning
            log("tputrain: %s: %d jobs not sent after %.0f s (the tracker is down or slow): "
                "they are lost when this process ends", self.name, self._queue.qsize(),
                timeout)
            return False
        return True

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            self._deliver(job)
            self._queue.task_done()

    def _deliver(self, job: Any) -> None:
        """Sends `job`, retrying until it goes through or the sender is closed."""
        pause = FIRST_PAUSE
        while not self._stop.is_set():
            try:
                self._send(job)
            except Exception as error:  # pylint: disable=broad-except  (any tracker failure)
                if not self.failing:
                    self.failing = True
                    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                    logging.warning("tputrain: %s: the tracker failed (%s: %s): training "
                                    "goes on; its metrics are queued and retried",
                                    self.name, type(error).__name__, first[:300])
                self._stop.wait(pause)
                pause = min(2 * pause, MAX_PAUSE)
                continue
            if self.failing:
                self.failing = False
                logging.info("tputrain: %s: the tracker answers again", self.name)
            self.sent += 1
            return
