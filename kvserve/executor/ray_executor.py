"""`ray`: one Ray actor per rank, on any number of nodes.

A placement group reserves one device per rank (GPUs, or CPUs on a CPU-only cluster) and is packed, so
the ranks fill nodes in order: ranks are then numbered node by node, which puts each tensor-parallel group
(tp consecutive ranks) inside one node and the pipeline stages across nodes (TP=8 x PP=2 on two 8-GPU
nodes: one stage per node). Everything that can be missing fails start-up within a bounded time with a
message that names it: devices the cluster lacks, a placement that cannot be satisfied, a worker that
failed to start, a rendezvous that timed out (KVSERVE_DIST_TIMEOUT).
"""

from __future__ import annotations

import logging
import os

from kvserve.executor.abstract import Executor, ExecutorDeadError

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = float(os.environ.get("KVSERVE_RAY_PLACEMENT_TIMEOUT", "30"))


class RayWorkerActor:
    """Runs in the actor: a Worker, which applies each step's message to its input batch."""

    def __init__(self, config, rank: int, output_rank: int):
        self.config, self.rank, self.output_rank = config, rank, output_rank
        self.worker = None
        self._deferred = None  # the step launched with grammar_bitmask_deferred, until its mask arrives

    def address(self) -> tuple[str, int]:
        import ray

        from kvserve.executor.multiproc_executor import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, init_method: str) -> None:
        from kvserve.worker.worker import Worker

        # Ray gives each actor its own device (CUDA_VISIBLE_DEVICES), so it is always local device 0.
        self.worker = Worker(self.config, self.rank, 0, init_method)
        self.worker.init_device()
        self.worker.load_model()

    def rpc(self, method: str, *args):
        result = getattr(self.worker, method)(*args)
        if method == "describe":
            import ray

            result["node"] = f"{result['node']} (ray node {ray.get_runtime_context().get_node_id()[:12]})"
            result["ray_node_id"] = ray.get_runtime_context().get_node_id()
        return result

    def execute(self, msg):
        pending = self.worker.execute_model(msg)
        if msg.grammar_bitmask_deferred:  # the forward is queued; the step's tokens come from sample_deferred
            self._deferred = pending
            return None
        return pending.result() if self.rank == self.output_rank else None

    def sample_deferred(self, bitmask, mask_row: dict[str, int]):
        """The mask of the step `execute` left waiting: every rank applies it and samples (each keeps its sampled
        ids for the next step's inputs); the output rank returns the step's tokens."""
        pending, self._deferred = self._deferred, None
        self.worker.sample_deferred(bitmask, mask_row)
        return pending.result() if self.rank == self.output_rank else None


class _PendingStep:
    """A launched step: `refs` are the actors' execute calls, or for a step whose grammar mask was deferred,
    their sample_deferred calls once send_grammar_bitmask has made them (always before the result is read)."""

    def __init__(self, executor: RayExecutor, refs: list):
        self.executor, self.refs = executor, refs
        self._value = None
        self._done = False

    def result(self):
        if not self._done:
            self._value = self.executor._get(self.refs)[self.executor.output_rank]
            self._done = True
        return self._value


class RayExecutor(Executor):
    def __init__(self, config):
        super().__init__(config)
        try:
            import ray
        except ImportError:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'kvserve[ray]'") from None
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        args = config.args
        self.world_size = world = args.world_size
        self.output_rank = world - args.tensor_parallel_size
        self._dead: str | None = None
        self._awaiting_mask: _PendingStep | None = None  # launched with grammar_bitmask_deferred, mask not yet sent
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, log_to_driver=True) if address else ray.init()
        device = "GPU" if config.device == "cuda" else "CPU"
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        per_node = [int(n["Resources"].get(device, 0)) for n in nodes]
        if sum(per_node) < world:
            raise ValueError(
                f"--tensor-parallel-size {args.tensor_parallel_size} x --pipeline-parallel-size "
                f"{args.pipeline_parallel_size} needs {world} {device}s, but the Ray cluster has {sum(per_node)} "
                f"({len(nodes)} node(s) with {per_node}). Start more nodes (ray start --address=HEAD:6379) or "
                f"lower the sizes.")
        self.pg = placement_group([{device: 1}] * world, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.pg)
            raise ValueError(
                f"Ray could not reserve {world} {device}s (one per rank) within {PLACEMENT_TIMEOUT_S:.0f} s; "
                f"free {device}s per node: {per_node}. Other jobs may hold them, or a node has not joined.")
        bundle_nodes = ray.util.placement_group_table(self.pg)["bundles_to_node_id"]
        # Ranks node by node: each TP group on one node, the pipeline stages across nodes.
        bundles = sorted(range(world), key=lambda b: (bundle_nodes[b], b))
        for stage in range(args.pipeline_parallel_size):
            group = bundles[stage * args.tensor_parallel_size:(stage + 1) * args.tensor_parallel_size]
            if len({bundle_nodes[b] for b in group}) > 1:
                self.shutdown()
                raise ValueError(
                    f"Pipeline stage {stage}'s {args.tensor_parallel_size} tensor-parallel ranks do not fit on one "
                    f"node ({device}s per node: {per_node}); use a --tensor-parallel-size of at most the "
                    f"{device}s of one node.")
        actor_cls = ray.remote(RayWorkerActor)
        resources = {"num_gpus": 1, "num_cpus": 0} if device == "GPU" else {"num_cpus": 1}
        self.actors = [
            actor_cls.options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundles[r]),
            ).remote(config, r, self.output_rank)
            for r in range(world)
        ]
        try:
            host, port = self._get([self.actors[0].address.remote()])[0]
            self._get([a.start.remote(f"tcp://{host}:{port}") for a in self.actors])
        except BaseException:
            self.shutdown()
            raise
        logger.info("Started %d Ray workers in placement group %s", world, self.pg.id.hex()[:12])

    def _get(self, refs: list) -> list:
        """Results of refs, in order; the first actor that fails or dies fails the wait at once."""
        ray = self._ray
        if self._dead:
            raise ExecutorDeadError(self._dead)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - an actor died or raised: no step can run any more
                rank = refs.index(done[0])
                self._dead = f"Ray worker rank {rank} failed: {type(e).__name__}: {str(e)[:2000]}"
                raise ExecutorDeadError(self._dead) from e
        return ray.get(refs)

    def collective_rpc(self, method: str, *args) -> list:
        return self._get([a.rpc.remote(method, *args) for a in self.actors])

    def execute_async(self, sched_out):
        if self._dead:
            raise ExecutorDeadError(self._dead)
        msg = self._ray.put(sched_out.message)  # serialized once for every actor
        launched = [a.execute.remote(msg) for a in self.actors]
        if not sched_out.message.grammar_bitmask_deferred:
            return _PendingStep(self, launched)
        # An actor runs its calls in order, so sample_deferred follows the forward it samples; a failure of the
        # launch shows in that later call's result.
        self._awaiting_mask = _PendingStep(self, launched)
        return self._awaiting_mask

    defers_grammar_bitmask = True

    def send_grammar_bitmask(self, bitmask, mask_row: dict[str, int]) -> None:
        step, self._awaiting_mask = self._awaiting_mask, None
        if step is None:
            raise RuntimeError("a grammar bitmask arrived for no step waiting for one")
        mask = self._ray.put(bitmask)  # serialized once for every actor
        step.refs = [a.sample_deferred.remote(mask, mask_row) for a in self.actors]

    def check_health(self) -> None:
        if self._dead:
            raise ExecutorDeadError(self._dead)

    def shutdown(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
