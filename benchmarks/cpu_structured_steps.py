"""The host side of structured outputs on W1's shape, without a GPU: the mask fill per step, and whether the
engine's step loop hides it behind the GPU.

    PYTHONPATH=. python benchmarks/cpu_structured_steps.py [--requests 256] [--tokenizer DIR] [--rounds 3]
        [--forward-ms 9] [--launch-ms 4] [--sample-ms 0.5] [--part fill|loop|all]

Every request's output is a JSON object of benchmarks/gpu_structured.py's SCHEMA with its strings near their
maxLength (what W1's dummy-weight outputs are like), tokenized by the Llama 3.1 tokenizer (128,256 tokens;
default: the team's shared/tokenizers/llama-3.1/), so the rows are the size and kind the GPU run fills.
1. fill: kvserve's StructuredOutputManager for all requests, step by step as they decode (each step's mask
   for the live requests, then each request's next token): ms per step and per row (wall and this thread's
   CPU time; the xgrammar on the path and the filler's threads are printed).
2. loop: the real LLMEngine (scheduler, manager, output processor, async scheduling) over a simulated GPU:
   launching a step costs --launch-ms of host (Python) time as the model runner's input build does, its
   forward takes --forward-ms of device time (the host sleeps, holding no GIL, only when it waits), and its
   sampling --sample-ms once its mask is in. The requests decode the same tokens with the schema and without
   it (ignore_eos, the same lengths); printed: ms per step of both, the ratio, the mask fill per step, and
   the GPU's wait for masks per step (fill not hidden behind the forward).
Defaults follow W1 on the H200 (BENCHMARKS.md: about 4 ms of launch, 8-9 ms of GPU wait per step). The
machine's other load moves wall times: the best of --rounds is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.gpu_structured import SCHEMA

WORDS = ["Wil", "son", " order", " café", " naïve", " 東京", " ok", "-", " Straße", " 💡", " zip", " note", "?"]


def default_tokenizer() -> str | None:
    for base in Path(__file__).resolve().parents:
        path = base / "shared" / "tokenizers" / "llama-3.1"
        if (path / "tokenizer.json").exists():
            return str(path)
    return None


def _text(rng: random.Random, lo: int, hi: int) -> str:
    """A string of lo..hi characters (near hi, as a dummy model's are), of words that tokenize variously."""
    target = rng.randint(max(lo, hi - 6), hi)
    out = ""
    while len(out) < target:
        out += rng.choice(WORDS)
    return out[:target].rstrip() if len(out[:target].rstrip()) >= lo else out[:target]


def sample_object(rng: random.Random) -> dict:
    """An object SCHEMA accepts."""
    return {
        "id": rng.randint(0, 1000000), "name": _text(rng, 4, 48),
        "status": rng.choice(["active", "inactive", "pending"]),
        "tags": [_text(rng, 2, 16) for _ in range(rng.randint(1, 6))],
        "lines": [{"sku": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3)) + "-"
                          + "".join(rng.choice("0123456789") for _ in range(4)),
                   "qty": rng.randint(1, 99), "note": _text(rng, 0, 32)} for _ in range(rng.randint(1, 4))],
        "address": {"city": _text(rng, 2, 24), "zip": "".join(rng.choice("0123456789") for _ in range(5))},
        "verified": rng.random() < 0.5,
    }


def trajectories(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n outputs' token ids: compact JSON as xgrammar writes it without any_whitespace, then the EOS."""
    import jsonschema

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        obj = sample_object(rng)
        jsonschema.validate(obj, SCHEMA)
        text = json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))
        out.append(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
    return out


def _constraint():
    from kvserve import StructuredOutputsParams

    return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def xgrammar_info() -> str:
    import importlib.metadata

    from kvserve.structured_output import backend_xgrammar

    filler = backend_xgrammar._batch_filler()
    threads = max(1, min(8, (os.cpu_count() or 2) // 2)) if filler is not None else 0
    return f"xgrammar {importlib.metadata.version('xgrammar')}, batch filler threads {threads}"


# ---- 1. the fill ----------------------------------------------------------------------------------------------
def fill_part(tokenizer, trajs: list[list[int]]) -> dict:
    from kvserve.structured_output.compiler import GrammarCompiler, StructuredOutputsConfig
    from kvserve.structured_output.manager import StructuredOutputManager

    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id], StructuredOutputsConfig(backend="xgrammar"))
    compiler.warm_up().result()
    mgr = StructuredOutputManager(compiler, vocab)
    for i in range(len(trajs)):
        mgr.add_request(str(i), _constraint(), [1])
    for i in range(len(trajs)):
        while mgr.status(str(i)) == "waiting":
            time.sleep(0.01)
    pos = [0] * len(trajs)
    live = list(range(len(trajs)))
    walls, cpus, rows = [], [], []
    while live:
        scheduled = [SimpleNamespace(request_id=str(i), needs_sample=True) for i in live]
        t, c = time.perf_counter(), time.thread_time()
        bitmask, _ = mgr.grammar_bitmask(scheduled)
        cpus.append(time.thread_time() - c)
        walls.append(time.perf_counter() - t)
        rows.append(bitmask.shape[0])
        nxt = []
        for i in live:
            done = mgr.accept_token(str(i), trajs[i][pos[i]])
            pos[i] += 1
            if not done:
                assert pos[i] < len(trajs[i]), "the grammar did not end with the object"
                nxt.append(i)
        live = nxt
    compiler.shutdown()
    walls_sorted = sorted(walls)
    return {"steps": len(walls), "rows_mean": statistics.mean(rows), "ms_mean": 1e3 * statistics.mean(walls),
            "ms_p99": 1e3 * walls_sorted[int(0.99 * (len(walls) - 1))], "cpu_ms_mean": 1e3 * statistics.mean(cpus),
            "ms_per_row": 1e3 * sum(walls) / sum(rows), "ms_full_steps": 1e3 * statistics.mean(
                [w for w, r in zip(walls, rows) if r == max(rows)])}


# ---- 2. the step loop over a simulated GPU -------------------------------------------------------------------
def _busy(ms: float) -> None:
    """Host work that holds the GIL, as the runner's Python input build does."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class SimulatedGpu:
    """An executor whose device work is a timeline: a step's forward starts when the device is free and it
    is launched, takes forward_ms; its sampling starts when the forward is done and its mask (if deferred)
    has arrived, takes sample_ms. result() sleeps until then. The tokens are each request's next one."""

    defers_grammar_bitmask = True
    in_engine_process = True

    def __init__(self, trajs: dict[str, list[int]], launch_ms: float, forward_ms: float, sample_ms: float):
        self.trajs, self.launch_ms = trajs, launch_ms
        self.forward_s, self.sample_s = forward_ms / 1e3, sample_ms / 1e3
        self.device_free = 0.0
        self.deferred = None
        self.mask_wait = []  # per deferred step: seconds the device waited for its mask after its forward
        self.positions: dict[str, int] = {}

    def execute_async(self, sched_out):
        from kvserve.worker.runner_output import RunnerOutput

        _busy(self.launch_ms)
        sampling = [s.request_id for s in sched_out.scheduled if s.needs_sample]
        tokens = []
        for rid in sampling:
            i = self.positions.get(rid, 0)
            self.positions[rid] = i + 1
            traj = self.trajs[rid]
            # Past its end: a step scheduled before the request's last token was seen (discarded).
            tokens.append([traj[i] if i < len(traj) else traj[-1]])
        now = time.perf_counter()
        forward_done = max(now, self.device_free) + self.forward_s
        step = SimpleNamespace(forward_done=forward_done, done=None,
                               out=RunnerOutput(req_ids=sampling, sampled_token_ids=tokens))
        if sched_out.message.grammar_bitmask_deferred:
            self.device_free = float("inf")  # nothing runs after it until its mask is in
            self.deferred = step
        else:
            step.done = forward_done + self.sample_s
            self.device_free = step.done
        return _Pending(step)

    def send_grammar_bitmask(self, bitmask, mask_row) -> None:
        step, self.deferred = self.deferred, None
        now = time.perf_counter()
        self.mask_wait.append(max(0.0, now - step.forward_done))
        step.done = max(now, step.forward_done) + self.sample_s
        self.device_free = step.done

    def collective_rpc(self, method, *args):
        return [None]

    def maybe_inject_step_oom(self):
        pass

    def shutdown(self):
        pass


class _Pending:
    def __init__(self, step):
        self.step = step

    def result(self):
        delay = self.step.done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self.step.out


def tiny_model(tokenizer_dir: str, vocab: int) -> str:
    import shutil

    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                      tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128009)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="kvserve-structured-steps-")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def loop_part(path: str, trajs: list[list[int]], args) -> dict:
    import torch

    from kvserve import LLM, SamplingParams

    llm = LLM(path, max_model_len=1024, kv_cache_memory_bytes=256 << 20, async_scheduling=True,
              max_num_seqs=len(trajs), structured_outputs_config='{"backend": "xgrammar"}')
    engine = llm.llm_engine
    real_executor = engine.executor
    fill = engine.structured_output.grammar_bitmask
    mask_times = []

    fixed_fill_s = [None]  # a sweep's fill: this many seconds outside the GIL, as a native multi-threaded fill

    def timed_fill(scheduled):
        t = time.perf_counter()
        if fixed_fill_s[0] is not None:
            time.sleep(fixed_fill_s[0])
            mask_times.append(time.perf_counter() - t)
            return torch.empty(0), {}
        out = fill(scheduled)
        if out[0] is not None:
            mask_times.append(time.perf_counter() - t)
        return out

    engine.structured_output.grammar_bitmask = timed_fill
    prompts = [{"prompt_token_ids": [128000] + [1000 + 7 * i + j for j in range(15)]} for i in range(len(trajs))]
    result = {}
    try:
        # Warm-up: the grammar compiles (then cached).
        engine.executor = SimulatedGpu({str(i): t for i, t in enumerate(trajs)}, 0, 0, 0)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, structured_outputs=_constraint(),
                                                 detokenize=False), use_tqdm=False)
        runs = [("constrained", None), ("unconstrained", None)] + [(f"fill {ms:g} ms", ms) for ms in args.fill_sweep]
        for name, fixed_ms in runs:
            fixed_fill_s[0] = None if fixed_ms is None else fixed_ms / 1e3
            best = None
            for _ in range(args.rounds):
                gpu = SimulatedGpu({}, args.launch_ms, args.forward_ms, args.sample_ms)
                engine.executor = gpu
                mask_times.clear()
                if name != "unconstrained":
                    params = SamplingParams(temperature=0, max_tokens=1000, detokenize=False,
                                            structured_outputs=_constraint())
                    params = [params] * len(trajs)
                else:
                    params = [SamplingParams(temperature=0, max_tokens=len(t), ignore_eos=True, detokenize=False)
                              for t in trajs]
                ids = []
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    ids.append(engine.add_request(None, p, params[i]))
                gpu.trajs = {str(rid): trajs[i] for i, rid in enumerate(ids)}
                steps, tokens = 0, 0
                while engine.has_unfinished_requests():
                    steps += 1
                    for o in engine.step():
                        if o.finished:
                            tokens += len(o.outputs[0].token_ids)
                seconds = time.perf_counter() - t0
                run = {"seconds": seconds, "steps": steps, "tokens": tokens, "ms_per_step": 1e3 * seconds / steps,
                       "mask_ms_mean": 1e3 * statistics.mean(mask_times) if mask_times else 0.0,
                       "mask_wait_ms_mean": 1e3 * statistics.mean(gpu.mask_wait) if gpu.mask_wait else 0.0}
                if best is None or run["seconds"] < best["seconds"]:
                    best = run
            result[name] = best
    finally:
        engine.executor = real_executor
        engine.shutdown()
    assert all(r["tokens"] == sum(map(len, trajs)) for r in result.values()), result
    for r in result.values():
        r["ratio"] = result["unconstrained"]["seconds"] / r["seconds"]
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokenizer", default=default_tokenizer())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launch-ms", type=float, default=4.0)
    ap.add_argument("--forward-ms", type=float, default=9.0)
    ap.add_argument("--sample-ms", type=float, default=0.5)
    ap.add_argument("--part", choices=["fill", "loop", "all"], default="all")
    ap.add_argument("--fill-sweep", type=lambda v: [float(x) for x in v.split(",") if x], default=[0.0, 1.0, 2.0, 4.0],
                    help="loop runs whose fill is replaced by these many ms outside the GIL (comma-separated)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.tokenizer is None:
        raise SystemExit("no Llama 3.1 tokenizer found: pass --tokenizer DIR (tokenizer.json, tokenizer_config.json)")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    trajs = trajectories(tokenizer, args.requests)
    result = {"cpu_cores": os.cpu_count(), "xgrammar": xgrammar_info(), "requests": args.requests,
              "output_tokens": sum(map(len, trajs))}
    print(f"{args.requests} requests, {result['output_tokens']} output tokens, vocab {len(tokenizer)}; "
          f"{result['xgrammar']}; {os.cpu_count()} CPU cores", flush=True)
    if args.part in ("fill", "all"):
        best = min((fill_part(tokenizer, trajs) for _ in range(args.rounds)), key=lambda r: r["ms_mean"])
        result["fill"] = best
        print(f"fill: {best['steps']} steps, {best['rows_mean']:.0f} rows/step: {best['ms_mean']:.2f} ms/step "
              f"(p99 {best['ms_p99']:.2f}, CPU {best['cpu_ms_mean']:.2f}), {best['ms_full_steps']:.2f} ms at "
              f"{args.requests} rows, {best['ms_per_row']:.3f} ms/row", flush=True)
    if args.part in ("loop", "all"):
        path = tiny_model(args.tokenizer, len(tokenizer))
        try:
            loop = loop_part(path, trajs, args)
        finally:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        result["loop"] = loop
        print(f"loop (launch {args.launch_ms} ms host, forward {args.forward_ms} ms, sample {args.sample_ms} ms "
              f"device):")
        print(f"  {'run':16} {'steps':>5} {'ms/step':>8} {'mask fill ms':>13} {'device waits for mask ms':>25} "
              f"{'throughput vs unconstrained':>28}")
        for name, r in loop.items():
            print(f"  {name:16} {r['steps']:5d} {r['ms_per_step']:8.2f} {r['mask_ms_mean']:13.2f} "
                  f"{r['mask_wait_ms_mean']:25.2f} {r['ratio']:27.3f}x")
        print("  (target: constrained >= 0.95x unconstrained; 'fill X ms' rows replace the fill by X ms outside "
              "the GIL)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
