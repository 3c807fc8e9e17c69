"""One device, in the engine's own process: the step's SchedulerOutput goes to the runner as it is
(no copy, no serialization)."""

from __future__ import annotations

from kvserve.executor.abstract import Executor
from kvserve.worker.worker import Worker


class UniExecutor(Executor):
    in_engine_process = True

    def __init__(self, config):
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    @property
    def runner(self):
        return self.worker.runner

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def execute_async(self, sched_out):
        return self.worker.runner.execute_async(sched_out)
