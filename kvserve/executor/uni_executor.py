"""One device, in the engine's own process: the step's message goes to the runner as it is (no
serialization), the same message the mp and ray executors send."""

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
        return self.worker.execute_model(sched_out.message)

    defers_grammar_bitmask = True

    def send_grammar_bitmask(self, bitmask, mask_row: dict[str, int]) -> None:
        self.worker.sample_deferred(bitmask, mask_row)
