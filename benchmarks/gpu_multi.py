"""Tensor and pipeline parallelism on one host with 2, 4 or 8 GPUs, in one command per machine kind.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_multi.py --gpus N --out $OUT [--quick] [--only a,b] [--skip x,y]
    python benchmarks/gpu_multi.py --cpu-smoke --out DIR   # the same code paths on CPU (gloo), tiny model

Rows per kind (names for --only / --skip in brackets):
- 2 GPUs: parity of TP=2 and PP=2 against TP=1 on a small random checkpoint: bf16 greedy agreement and the
  largest logprob difference of the chosen tokens, fp32 tokens identical [parity]; Llama-3.1-8B shape W1 at
  TP=1 and TP=2 [8b_tp1, 8b_tp2]; Llama-3.1-70B shape W1 + batch-1 at TP=2 [70b_tp2], W1 at PP=2 [70b_pp2];
  vLLM 0.26.0 at TP=2 on the same 70B W1 when its bundle is in .vllm/ [vllm_70b_tp2].
- 4 GPUs: 70B W1 at TP=4 [70b_tp4], TP=2 x PP=2 [70b_tp2pp2], TP=2 for the speed-up [70b_tp2].
- 8 GPUs: 70B W1 at TP=8 [70b_tp8]; TP=4 x PP=2 through Ray on two Ray nodes of 4 GPUs each
  [70b_tp4pp2_ray]; Llama-3.1-405B shape at TP=8, batch-1 and a reduced W1, if `kvserve plan` says it
  fits [405b_tp8].
Every row: start-to-ready time, per-rank memory (weights and KV from the layout, device memory used),
output tok/s, and per step the split into compute and communication: collectives and stage transfers are
timed with CUDA events (KVSERVE_COMM_TIMER=1) in eager steps; CUDA-graph replays are invisible to that
timer, so their communication is estimated as 2 x layers x one measured all-reduce of the step's batch.

Each row runs in its own child process with a timeout (a hang or crash costs that row only, and the GPUs
are free again for the next row); rows are skipped, not started, once the time budget (--budget-s) would be
exceeded. Results: OUT/gpu_multi_<N>gpu.json (one row per run) and a table printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_w1 import W1_CONFIG, batch1_request, w1_requests, write_config  # noqa: E402

SHAPES = {
    "8b": W1_CONFIG,
    "70b": dict(W1_CONFIG, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
    "405b": dict(W1_CONFIG, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128, num_key_value_heads=8),
    "tiny": dict(W1_CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, torch_dtype="float32"),
}
GPU_ENGINE = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
CPU_ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20,
                  max_num_batched_tokens=64, max_num_seqs=8)
VLLM_TP2_EXTRA = '{"tensor_parallel_size": 2, "compilation_config": {"pass_config": {"fuse_allreduce_rms": false}}}'


def row(name, shape="70b", tp=1, pp=1, work=("w1",), backend=None, ray_nodes=0, timeout_s=300, n_w1=None):
    return dict(name=name, shape=shape, tp=tp, pp=pp, work=list(work), backend=backend, ray_nodes=ray_nodes,
                timeout_s=timeout_s, n_w1=n_w1)


def plan_rows(gpus: int, quick: bool) -> list[dict]:
    """The rows of one kind, most important first (a row that would overrun the budget is skipped)."""
    if gpus == 2:
        return [
            row("parity", shape="parity", work=("parity",), timeout_s=240),
            row("8b_tp1", shape="8b", tp=1, timeout_s=150),
            row("8b_tp2", shape="8b", tp=2, timeout_s=150),
            row("70b_tp2", tp=2, work=("w1", "bs1"), timeout_s=300),
            row("vllm_70b_tp2", shape="vllm", tp=2, timeout_s=450),
            row("70b_pp2", pp=2, timeout_s=300),
        ]
    if gpus == 4:
        return [
            row("70b_tp4", tp=4, work=("w1", "bs1"), timeout_s=240),
            row("70b_tp2pp2", tp=2, pp=2, timeout_s=240),
            row("70b_tp2", tp=2, timeout_s=240),
        ]
    if gpus == 8:
        return [
            row("70b_tp8", tp=8, work=("w1", "bs1"), timeout_s=200),
            row("70b_tp4pp2_ray", tp=4, pp=2, backend="ray", ray_nodes=2, timeout_s=240),
            row("405b_tp8", shape="405b", tp=8, work=("bs1", "w1"), n_w1=32 if quick else 64, timeout_s=300),
        ]
    raise ValueError(f"--gpus must be 2, 4 or 8, got {gpus}")


def cpu_smoke_rows() -> list[dict]:
    tiny = dict(shape="tiny", work=("w1", "bs1"), timeout_s=300, n_w1=6)
    return [
        row("parity", shape="parity", work=("parity",), timeout_s=400),
        row("tiny_tp1", tp=1, **tiny),
        row("tiny_tp2", tp=2, **tiny),
        row("tiny_pp2", pp=2, **tiny),
        row("tiny_tp2pp2", tp=2, pp=2, **tiny),
        row("tiny_tp2pp2_ray", tp=2, pp=2, backend="ray", ray_nodes=2, **tiny),
    ]


# ---- one row, in a child process ---------------------------------------------------------------------
def greedy(max_tokens, logprobs=None):
    from kvserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs)


def engine_kwargs(spec: dict, cpu: bool) -> dict:
    kw = dict(CPU_ENGINE if cpu else GPU_ENGINE, tensor_parallel_size=spec["tp"], pipeline_parallel_size=spec["pp"])
    if spec["backend"]:
        kw["distributed_executor_backend"] = spec["backend"]
    return kw


def start_ray_nodes(spec: dict, cpu: bool):
    """Two Ray nodes on this host, each owning half the devices: the layout of a two-node deployment.
    A raylet takes the GPU ids it may hand out from CUDA_VISIBLE_DEVICES at its start, so each node starts
    with its own half visible; its actors then see only their own GPU."""
    import ray
    from ray.cluster_utils import Cluster

    world = spec["tp"] * spec["pp"]
    per_node = world // spec["ray_nodes"]
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    cluster = Cluster()
    try:
        for node in range(spec["ray_nodes"]):
            if cpu:
                res = dict(num_cpus=per_node, object_store_memory=80 << 20)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * per_node + i) for i in range(per_node))
                res = dict(num_cpus=per_node * 2, num_gpus=per_node, object_store_memory=2 << 30)
            if node == 0:
                res["include_dashboard"] = False
            cluster.add_node(**res)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def make_parity_checkpoint(cpu: bool) -> str:
    import torch
    import transformers

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512) if cpu else dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=32000)
    cfg = transformers.LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=500000.0,
                                   **size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # fp32; kvserve casts to the serving dtype
    path = tempfile.mkdtemp(prefix="kvserve-multi-parity-")
    model.save_pretrained(path)
    return path


def generate(llm, prompts, max_tokens: list[int], logprobs=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n, logprobs) for n in max_tokens],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def run_parity(cpu: bool) -> dict:
    """TP=2, PP=2 (and TP=2 x PP=2 on CPU) against TP=1 on the same checkpoint: fp32 tokens identical;
    bf16 greedy agreement and the largest |logprob| difference of the chosen token before the first split."""
    from kvserve import LLM

    path = make_parity_checkpoint(cpu)
    vocab = 512 if cpu else 32000
    rng = random.Random(2)
    prompts = [[rng.randint(3, vocab - 1) for _ in range(rng.randint(5, 60 if cpu else 400))] for _ in range(8)]
    n_new = 12 if cpu else 32
    layouts = [(2, 1), (1, 2)] + ([(2, 2)] if cpu else [])
    base = dict(CPU_ENGINE) if cpu else dict(max_model_len=1024, gpu_memory_utilization=0.3)
    res = {}
    for dtype in ("float32", "bfloat16"):
        ref = None
        for tp, pp in [(1, 1)] + layouts:
            kw = dict(base, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp)
            llm = LLM(path, skip_tokenizer_init=True, **kw)
            outs = generate(llm, prompts, [n_new] * len(prompts), logprobs=0)
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            if not cpu:  # the next engine's workers count what this process still caches as "others"
                import torch

                torch.cuda.empty_cache()
            toks = [o.token_ids for o in outs]
            lps = [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids)] for o in outs]
            if ref is None:
                ref = (toks, lps)
                continue
            agree, total, max_err = 0, 0, 0.0
            for (rt, rl), (t, lp) in zip(zip(*ref), zip(toks, lps)):
                split = next((i for i, (a, b) in enumerate(zip(rt, t)) if a != b), len(rt))
                agree += split
                total += len(rt)
                # Up to and including the first split the inputs are the same: the logprobs are comparable.
                for i in range(min(split + 1, len(rt))):
                    max_err = max(max_err, abs(rl[i] - lp[i]))
            res[f"{dtype}_tp{tp}_pp{pp}"] = dict(identical=toks == ref[0], greedy_agreement=round(agree / total, 4),
                                                 max_logprob_error=round(max_err, 5))
            print(f"  parity {dtype} tp={tp} pp={pp}: {res[f'{dtype}_tp{tp}_pp{pp}']}", flush=True)
    res["fp32_identical"] = all(v["identical"] for k, v in res.items() if k.startswith("float32"))
    return res


def comm_split(llm, spec: dict, elapsed: float, n_out: int, cpu: bool) -> dict:
    """Per step: wall time, measured eager communication, estimated communication of graph replays."""
    executor = llm.llm_engine.executor
    stats = [s for s in executor.collective_rpc("comm_stats", True) if s]
    if not stats or not max(s["steps"] for s in stats):  # `uni` (TP=1) runs no worker steps: nothing to split
        return {}
    # The output rank (TP rank 0 of the last stage) sees every step; communication: the slowest rank's.
    steps = max(s["steps"] for s in stats)
    eager = max(s["eager_steps"] for s in stats)
    comm = max(sum(s["seconds"].values()) for s in stats)
    kinds = {k: round(max(s["seconds"].get(k, 0.0) for s in stats), 4) for k in
             sorted({k for s in stats for k in s["seconds"]})}
    res = dict(steps=steps, eager_steps=eager, ms_per_step=round(1000 * elapsed / max(steps, 1), 3),
               comm_s_timed=round(comm, 4), comm_s_by_kind=kinds)
    graph_steps = steps - eager
    est = 0.0
    # Steps without a Python-level collective are CUDA-graph replays (TP only: PP runs eagerly).
    if graph_steps and spec["tp"] > 1 and spec["pp"] == 1 and not cpu:
        batch = max(1, round(n_out / max(steps, 1)))
        probe = max(p for p in executor.collective_rpc("probe_all_reduce", batch) if p is not None)
        layers = SHAPES[spec["shape"]]["num_hidden_layers"] // spec["pp"]
        est = graph_steps * 2 * layers * probe
        res.update(graph_steps=graph_steps, all_reduce_probe_us=round(1e6 * probe, 2), probe_batch=batch)
    total_comm = comm + est
    res["comm_ms_per_step"] = round(1000 * total_comm / max(steps, 1), 3)
    res["compute_ms_per_step"] = round(1000 * (elapsed - total_comm) / max(steps, 1), 3)
    res["comm_share"] = round(total_comm / elapsed, 4) if elapsed else None
    return res


def run_engine_row(spec: dict, cpu: bool) -> dict:
    from kvserve import LLM

    cfg = SHAPES[spec["shape"]]
    path = write_config(cfg)
    reqs = w1_requests()
    n_w1 = spec["n_w1"] or (64 if spec.get("quick") else len(reqs))
    reqs = reqs[:n_w1]
    if cpu:
        reqs = [([t % cfg["vocab_size"] for t in p[:40]], 8) for p, _ in reqs]
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, **engine_kwargs(spec, cpu))
    res = dict(start_to_ready_s=round(time.perf_counter() - t0, 1))
    executor = llm.llm_engine.executor
    res["layout"] = [dict(rank=r["rank"], tp=r["tp_rank"], pp=r["pp_rank"], node=r["node"], device=r["device"],
                          layers=list(r["layers"]), weights_gib=round(r["weights_bytes"] / 2**30, 3),
                          kv_gib=round(r["kv_bytes"] / 2**30, 3), ray_node_id=r.get("ray_node_id"))
                     for r in executor.layout]
    res["memory"] = executor.collective_rpc("memory_report")
    print(f"  ready in {res['start_to_ready_s']} s; ranks: " + "; ".join(
        f"r{r['rank']} {r['device']} L{r['layers'][0]}-{r['layers'][1] - 1} "
        f"w {r['weights_gib']} GiB kv {r['kv_gib']} GiB"
        for r in res["layout"]), flush=True)
    generate(llm, [p for p, _ in reqs[:4]], [8] * min(4, len(reqs)))  # warm-up (JIT, allocator)
    executor.collective_rpc("comm_stats", True)
    for work in spec["work"]:
        assert llm.llm_engine.kv_cache_manager.reset_prefix_cache()
        if work == "w1":
            t = time.perf_counter()
            outs = generate(llm, [p for p, _ in reqs], [o for _, o in reqs])
            elapsed = time.perf_counter() - t
            n_out = sum(len(o.token_ids) for o in outs)
            assert n_out == sum(o for _, o in reqs), (n_out, sum(o for _, o in reqs))
            res["w1"] = dict(requests=len(reqs), seconds=round(elapsed, 2), output_tokens=n_out,
                             output_tok_s=round(n_out / elapsed, 1), **comm_split(llm, spec, elapsed, n_out, cpu))
        elif work == "bs1":
            prompt, n = batch1_request()
            if cpu:
                prompt, n = [t % cfg["vocab_size"] for t in prompt[:32]], 16
            t = time.perf_counter()
            out = generate(llm, [prompt], [n])[0]
            elapsed = time.perf_counter() - t
            res["bs1"] = dict(seconds=round(elapsed, 3), output_tok_s=round(len(out.token_ids) / elapsed, 1),
                              **comm_split(llm, spec, elapsed, len(out.token_ids), cpu))
        print(f"  {work}: {json.dumps({k: v for k, v in res[work].items() if k != 'comm_s_by_kind'})}", flush=True)
    llm.llm_engine.shutdown()
    return res


def run_child(spec: dict, cpu: bool, out_file: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("kvserve.engine", "kvserve.worker.model_runner"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cluster = None
    if spec["ray_nodes"]:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise SystemExit("blocked: ray is not installed here (pip install 'kvserve[ray]')") from None
        cluster = start_ray_nodes(spec, cpu)
    try:
        res = run_parity(cpu) if spec["shape"] == "parity" else run_engine_row(spec, cpu)
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    with open(out_file, "w") as f:
        json.dump(res, f)


# ---- the driver ------------------------------------------------------------------------------------------
def run_vllm(spec: dict, out: str, quick: bool) -> dict:
    """vLLM's own benchmark script, as it is, from the vLLM 0.26.0 bundle copied into the git-ignored .vllm/."""
    bench = os.path.join(os.getcwd(), ".vllm", "vllm_bench.py")
    if not os.path.exists(bench):
        return dict(status="skipped: no vLLM bundle in .vllm/")
    if not os.path.isdir("/tmp/vllmsite/vllm"):
        r = subprocess.run(["bash", ".vllm/install.sh"], capture_output=True, text=True)
        if r.returncode:
            return dict(status=f"skipped: vLLM install failed: {(r.stdout + r.stderr)[-300:]}")
    vout = os.path.join(out, "vllm")
    os.makedirs(vout, exist_ok=True)
    cmd = [sys.executable, bench, "--shape", "70b", "--extra", VLLM_TP2_EXTRA]
    if quick:
        cmd += ["--num-requests", "64"]
    env = dict(os.environ, OUT=vout)
    try:
        r = subprocess.run(cmd, env=env, timeout=spec["timeout_s"], capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(status=f"timeout after {spec['timeout_s']} s")
    with open(os.path.join(out, "vllm_70b_tp2.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    path = os.path.join(vout, "vllm_bench.json")
    if r.returncode or not os.path.exists(path):
        return dict(status=f"failed rc={r.returncode}: {(r.stdout + r.stderr)[-600:]}")
    with open(path) as f:
        v = json.load(f)
    return dict(status="ok", start_to_ready_s=v.get("init_s"),
                w1=dict(requests=v.get("num_requests"), seconds=v.get("elapsed_s"),
                        output_tok_s=v.get("vllm_offline_out_tok_per_s")),
                bs1=dict(output_tok_s=v.get("bs1_out_tok_per_s")), raw=v)


def ray_available() -> bool:
    """Ray importable by the row's child (and the Ray workers it starts): the machine's own, or the
    bundle from benchmarks/ray_bundle.py unpacked to /tmp/raysite and put at the end of PYTHONPATH."""
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        return True
    from ray_bundle import unpack

    site = unpack()
    if site is None:
        return False
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [site])
    return True


def check_405b_fits(gpus: int) -> str | None:
    """None if `kvserve plan` says the 405B shape fits at TP=gpus on an H200, else its verdict."""
    path = write_config(SHAPES["405b"])
    r = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "plan", path, "-tp", str(gpus),
                        "--gpu", "H200", "--max-model-len", "4096", "--json"], capture_output=True, text=True)
    try:
        verdict = json.loads(r.stdout)["verdict"]
    except (ValueError, KeyError):
        return f"kvserve plan failed: {(r.stdout + r.stderr)[-300:]}"
    print(f"  kvserve plan 405B tp={gpus}: {verdict['message']}", flush=True)
    return None if verdict["step"] == "fits" else verdict["message"]


def run_row(spec: dict, args, cpu: bool) -> dict:
    if spec["shape"] == "vllm":
        return run_vllm(spec, args.out, args.quick)
    if spec["shape"] == "405b":
        reason = check_405b_fits(spec["tp"] * spec["pp"])
        if reason:
            return dict(status=f"skipped: {reason}")
    if spec["ray_nodes"] and not ray_available():
        return dict(status="blocked: Ray is not installed here and no Ray bundle in .ray/ (see ray_bundle.py)")
    spec = dict(spec, quick=args.quick)
    out_file = os.path.join(args.out, f"row_{spec['name']}.json")
    env = dict(os.environ, KVSERVE_COMM_TIMER="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--child-out", out_file]
    if cpu:
        cmd.append("--cpu-smoke")
    try:
        # Its own process group: a timeout ends the row's worker processes too.
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        rc = proc.wait(timeout=spec["timeout_s"])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return dict(status=f"timeout after {spec['timeout_s']} s")
    if rc or not os.path.exists(out_file):
        return dict(status=f"failed rc={rc} (its output is above)")
    with open(out_file) as f:
        return dict(status="ok", **json.load(f))


def fmt(x, unit=""):
    return "-" if x is None else f"{x}{unit}"


def print_table(label: str, results: dict) -> None:
    print(f"\n### {label}\n")
    print("| row | status | ready s | W1 out tok/s | bs1 tok/s | ms/step | compute ms | comm ms (share) | "
          "per-rank weights / KV / used GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name == "parity":
            continue
        w1, b1 = r.get("w1") or {}, r.get("bs1") or {}
        step = w1 or b1
        mem = {m["rank"]: m for m in r.get("memory", [])}
        ranks = ", ".join(f"{l['weights_gib']:.1f}/{l['kv_gib']:.1f}/{mem.get(l['rank'], {}).get('used_gib', 0):.1f}"
                          for l in r.get("layout", []))
        share = step.get("comm_share")
        print(f"| {name} | {r['status'][:60]} | {fmt(r.get('start_to_ready_s'))} | {fmt(w1.get('output_tok_s'))} | "
              f"{fmt(b1.get('output_tok_s'))} | {fmt(step.get('ms_per_step'))} | "
              f"{fmt(step.get('compute_ms_per_step'))} | "
              f"{fmt(step.get('comm_ms_per_step'))} ({fmt(None if share is None else round(100 * share, 1), '%')}) | "
              f"{ranks or '-'} |")
    if "parity" in results:
        p = results["parity"]
        print(f"\nparity ({p['status']}): " + "; ".join(
            f"{k}: agree {v['greedy_agreement']}, max logprob err {v['max_logprob_error']}, identical {v['identical']}"
            for k, v in p.items() if isinstance(v, dict)))
    speedups = []
    for base, other in [("8b_tp1", "8b_tp2"), ("70b_tp2", "70b_tp4"), ("70b_tp2", "70b_tp2pp2"),
                        ("70b_tp2", "70b_pp2"), ("vllm_70b_tp2", "70b_tp2"), ("tiny_tp1", "tiny_tp2")]:
        a = (results.get(base) or {}).get("w1", {}).get("output_tok_s")
        b = (results.get(other) or {}).get("w1", {}).get("output_tok_s")
        if a and b:
            speedups.append(f"{other} / {base}: {b / a:.3f}x")
    if speedups:
        print("\nW1 ratios: " + "; ".join(speedups))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, help="GPUs of this machine: 2, 4 or 8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="W1's first 64 requests (405B: 32)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (gloo): TP/PP via mp, 2-node Ray")
    ap.add_argument("--only", default="", help="comma-separated row names to run")
    ap.add_argument("--skip", default="", help="comma-separated row names not to run")
    ap.add_argument("--budget-s", type=float, default=560, help="no row starts that could end after this")
    ap.add_argument("--dry-run", action="store_true", help="print the rows that would run, and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(json.loads(args.child), args.cpu_smoke, args.child_out)
        return
    # Absolute: Ray workers do not start in this directory, and PYTHONPATH=. must still find kvserve.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    args.out = os.path.abspath(args.out)
    t_start = time.monotonic()
    rows = cpu_smoke_rows() if args.cpu_smoke else plan_rows(args.gpus, args.quick)
    only, skip = set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(",")))
    rows = [r for r in rows if (not only or r["name"] in only) and r["name"] not in skip]
    if args.dry_run:
        for r in rows:
            print(json.dumps(r))
        return
    os.makedirs(args.out, exist_ok=True)
    label = "CPU smoke" if args.cpu_smoke else f"{args.gpus} x GPU" + (" (quick)" if args.quick else "")
    results = {}
    for spec in rows:
        left = args.budget_s - (time.monotonic() - t_start)
        if left < 30:
            results[spec["name"]] = dict(status=f"skipped: {left:.0f} s of the budget left")
            continue
        spec["timeout_s"] = min(spec["timeout_s"], left)
        print(f"[{time.monotonic() - t_start:6.0f} s] {spec['name']} (tp={spec['tp']} pp={spec['pp']} "
              f"shape={spec['shape']}, timeout {spec['timeout_s']:.0f} s)", flush=True)
        t = time.monotonic()
        results[spec["name"]] = run_row(spec, args, args.cpu_smoke)
        results[spec["name"]]["row_seconds"] = round(time.monotonic() - t, 1)
        print(f"  -> {results[spec['name']]['status']} in {results[spec['name']]['row_seconds']} s", flush=True)
    # Same greedy tokens through every layout of the same dummy shape is not expected (each layout draws
    # its own random shards); parity uses a real checkpoint for that. Drop the token lists from the JSON.
    for r in results.values():
        r.pop("w1_tokens", None)
    name = "gpu_multi_cpu_smoke.json" if args.cpu_smoke else f"gpu_multi_{args.gpus}gpu.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(dict(label=label, rows=results), f, indent=1)
    print_table(label, results)
    failed = [n for n, r in results.items() if r["status"].startswith(("failed", "timeout"))]
    parity = results.get("parity", {})
    if failed or (parity.get("status") == "ok" and not parity.get("fp32_identical")):
        print(f"\nFAILED rows: {failed}; fp32 parity identical: {parity.get('fp32_identical')}")
        sys.exit(1)


if __name__ == "__main__":
    main()
