"""The Ray executor on a two-node Ray cluster inside the test (CPU only: each rank reserves one CPU):
TP=2 x PP=2 puts stage 0 on one node and stage 1 on the other and gives the single-process tokens;
asking for more devices than the cluster has fails at once with a message naming the numbers."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402

PROMPTS = [[5 + 3 * i + j for j in range(18 + 5 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=32, max_num_seqs=4)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                       "object_store_memory": 80 << 20})
    c.add_node(num_cpus=2, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _tokens(llm_or_engine) -> list[list[int]]:
    outs = llm_or_engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_tp2_pp2_across_two_nodes_same_tokens(cluster, tiny_model_factory):
    path, _ = tiny_model_factory("llama")  # 4 heads, 2 KV heads, 2 layers: one per stage
    expected = _tokens(LLM(path, **ENGINE))
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        layout = llm.llm_engine.executor.layout
        stage_nodes = [{r["ray_node_id"] for r in layout if r["pp_rank"] == stage} for stage in (0, 1)]
        assert all(len(nodes) == 1 for nodes in stage_nodes)  # each TP group inside one node
        assert stage_nodes[0] != stage_nodes[1]  # the stages on different nodes
        assert {r["ray_node_id"] for r in layout} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert _tokens(llm) == expected
    finally:
        llm.llm_engine.shutdown()


def test_more_devices_than_the_cluster_has_fails_with_the_numbers(cluster, tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=r"needs 8 CPUs, but the Ray cluster has 4 \(2 node"):
        LLMEngine(EngineArgs(model=path, tensor_parallel_size=4, pipeline_parallel_size=2,
                             distributed_executor_backend="ray", **ENGINE))
    # It fails before any worker or placement group is created: nothing is left in the cluster.
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
