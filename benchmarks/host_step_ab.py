"""Host time per decode step, two trees in one command: the scheduler, the step message, the worker's input
batch and the update, for 256 running decode requests, with the model's forward replaced by zeros.

    PYTHONPATH=$PWD python benchmarks/host_step_ab.py [--old a34d16e] [--rounds 5] [--steps 64] [--profile]
    PYTHONPATH=$PWD python benchmarks/host_step_ab.py --spec [--spec-old COMMIT] [--num-reqs 64] [--prompt-len 512]

The old tree is checked out with `git worktree add /tmp/old-<commit> <commit>` (once; reused after). Each
round runs one subprocess per tree, alternating old/new so load drift on a shared machine hits both, with
PYTHONPATH set to that tree. A child builds a 2-layer, hidden-64 Llama (dummy weights), adds 256 requests,
runs their prefill, then times `--steps` decode steps of engine.step(). The forward and the logits are
zeros, so the step is host work only: schedule (with the step message) / launch (the worker's input batch
and layout, tensors, greedy sampling of 256 rows) / wait / update, and the rest (output processing). Every number is main-thread CPU time per
step (the machine's other load does not inflate it), best over rounds; the parts exclude garbage collection, which
has its own row (step_no_gc = step - gc); "calls" is the Python function calls
per step under cProfile, which is exact and load-free. --profile prints each tree's top functions.
Async scheduling is on, as on CUDA. Only APIs present at a34d16e are used, so one file measures both trees.

--spec: speculation off against `{"method": "ngram"}` turned down, in this tree (and, with --spec-old, in
another tree too). A child builds both engines and steps them in turn (the order alternating), so the load
of a shared machine drifts over both alike. The n-gram engine gets the draft budget it would have on CUDA (a
CPU budget would turn drafts down at any batch past a few requests), and the fake model's greedy token is a
function of the position, so the prompt-lookup drafts are never right (the budget learns that and turns
itself down, probing now and then). The table also counts the timed steps that drafted (probes, or the
first steps before the budget has measured anything).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
PARTS = ("schedule", "launch", "wait", "update")
_gc_cpu = [0.0]  # CPU time spent in the garbage collector so far (every generation)


def _count_gc() -> None:
    import gc

    start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            start[0] = time.thread_time()
        else:
            _gc_cpu[0] += time.thread_time() - start[0]
    gc.callbacks.append(on_gc)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- child: one tree, one engine (or, with --spec, two stepped in turn) ------------------------------
_active: list[dict] = [{}]  # the part totals of the engine stepping now (PendingOutput.result is per class)


def _timed_parts(engine, totals: dict) -> None:
    """Wraps schedule / execute_async / PendingOutput.result / update to add their CPU time to totals, less
    the garbage collections that ran inside them (counted apart: a collection lands wherever it falls)."""
    from kvserve.worker.runner_output import PendingOutput

    def wrap(name, fn, into=None):
        def timed(*a, **kw):
            c, g = time.thread_time(), _gc_cpu[0]
            r = fn(*a, **kw)
            (into or _active[0])[name] += time.thread_time() - c - (_gc_cpu[0] - g)
            return r
        return timed

    sched, executor = engine.scheduler, engine.executor
    sched.schedule = wrap("schedule", sched.schedule, totals)
    executor.execute_async = wrap("launch", executor.execute_async, totals)
    sched.update = wrap("update", sched.update, totals)
    if not getattr(PendingOutput, "_host_step_ab_timed", False):
        PendingOutput.result = wrap("wait", PendingOutput.result)
        PendingOutput._host_step_ab_timed = True


def _fake_model(model, by_position: bool = False) -> None:
    """The forward returns zero hidden states (one row per token) and the logits are zeros: no compute, the
    same shapes downstream (greedy sampling then picks token 0, harmless under ignore_eos). `by_position`:
    the hidden state carries the position and the logits are one-hot at a token that is a function of it,
    so the outputs never repeat an n-gram the way a run of zeros does."""
    import torch

    hidden_size, vocab_size = TINY_CONFIG["hidden_size"], TINY_CONFIG["vocab_size"]

    def forward(input_ids, positions, *a, **kw):
        hidden = torch.zeros(input_ids.shape[0], hidden_size, dtype=torch.float32, device=input_ids.device)
        if by_position:
            hidden[:, 0] = positions.float()
        return hidden

    def compute_logits(hidden):
        logits = torch.zeros(hidden.shape[0], vocab_size, dtype=torch.float32, device=hidden.device)
        if by_position:
            token = (hidden[:, 0].long() * 7919 + 13) % (vocab_size - 3) + 3
            logits[torch.arange(hidden.shape[0]), token] = 1.0
        return logits
    model.forward = forward  # nn.Module.__call__ finds the instance attribute
    model.compute_logits = compute_logits


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


class _Arm:
    """One engine with 256 (num_reqs) decoding requests, and the CPU time of its steps by part."""

    def __init__(self, num_reqs: int, steps: int, prompt_len: int, spec: str):
        from kvserve import LLM, SamplingParams
        from kvserve.sampling_params import RequestOutputKind

        path = tempfile.mkdtemp(prefix="kvserve-host-ab-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
        tokens_per_req = prompt_len + 3 * steps + 128
        llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32",
                  max_model_len=max(1024, tokens_per_req), max_num_seqs=num_reqs, max_num_batched_tokens=8192,
                  kv_cache_memory_bytes=num_reqs * tokens_per_req * 1024 + (64 << 20), async_scheduling=True,
                  **({"speculative_config": NGRAM} if spec == "ngram" else {}))
        self.llm, self.engine, self.num_reqs = llm, llm.llm_engine, num_reqs
        _fake_model(self.engine.runner.model, by_position=bool(spec))
        if spec == "ngram":
            from kvserve.spec_decode.drafter import Drafter

            self.engine.drafter = self.engine.proposer = Drafter(self.engine.config.args.speculative_config, "cuda")
        self.totals = dict.fromkeys(PARTS, 0.0)
        _timed_parts(self.engine, self.totals)
        self.reset()
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=3 * steps + 16, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for i in range(num_reqs):
            ids = [rng.randint(3, TINY_CONFIG["vocab_size"] - 1) for _ in range(prompt_len)]
            self.engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        sched = self.engine.scheduler
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            self.step()
        for _ in range(4):  # warm: every request decoding, the pipeline full
            self.step()
        self.check()
        self.reset()

    def check(self) -> None:
        n = len(self.engine.scheduler.running)
        assert n == self.num_reqs, f"{n} running, expected {self.num_reqs}"

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0
        self.cpu = self.gc = 0.0
        self.steps = self.drafting_steps = 0

    def step(self) -> None:
        _active[0] = self.totals
        c, g = time.thread_time(), _gc_cpu[0]
        self.engine.step()
        self.cpu += time.thread_time() - c
        self.gc += _gc_cpu[0] - g
        self.steps += 1
        drafter = getattr(self.engine, "drafter", None)  # absent in old trees
        self.drafting_steps += drafter is not None and drafter.last_choice.num_draft_tokens > 0

    def result(self) -> dict:
        import kvserve

        n = self.steps
        res = {"kvserve": os.path.dirname(kvserve.__file__), "step": self.cpu / n, "gc": self.gc / n,
               "drafting_steps": self.drafting_steps, **{k: v / n for k, v in self.totals.items()}}
        res["step_no_gc"] = res["step"] - res["gc"]
        res["rest"] = res["step_no_gc"] - sum(res[k] for k in PARTS)
        return res


def _calls(arms: list, steps: int, profile: bool) -> list[tuple[float, str]]:
    """Python function calls per step of each arm under cProfile (exact and load-free), and its top functions."""
    out = []
    for arm in arms:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            arm.step()
        prof.disable()
        text = ""
        if profile:
            s = io.StringIO()
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(40)
            text = s.getvalue()
        out.append((pstats.Stats(prof).total_calls / steps, text))
        arm.check()
    return out


def child(num_reqs: int, steps: int, profile: bool, spec: bool = False, prompt_len: int = 32) -> dict:
    """The plain engine; or, with `spec`, engines without speculation ("off") and with ngram ("ngram")
    stepped in turn (the order alternating), so the machine's load drifts over both alike."""
    import torch

    torch.set_num_threads(1)
    _count_gc()
    names = ("off", "ngram") if spec else ("plain",)
    arms = [_Arm(num_reqs, steps, prompt_len, name if spec else "") for name in names]
    for i in range(steps):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            arm.step()
    results = {name: arm.result() for name, arm in zip(names, arms)}
    for (calls, text), name in zip(_calls(arms, steps, profile), names):
        results[name]["calls"] = calls
        if profile:
            results[name]["profile"] = text
    return results if spec else results["plain"]


# ---- parent: both trees, alternating ---------------------------------------------------------------
def old_tree(commit: str) -> str:
    path = f"/tmp/old-{commit}"
    if not os.path.isdir(os.path.join(path, "kvserve")):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, commit], check=True)
    return path


def run_child(tree: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--num-reqs", str(args.num_reqs),
           "--steps", str(args.steps), "--prompt-len", str(args.prompt_len)]
    cmd += (["--profile"] if args.profile else []) + (["--spec"] if args.spec else [])
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for r in (res.values() if args.spec else [res]):
        assert os.path.realpath(r["kvserve"]).startswith(os.path.realpath(tree)), (r["kvserve"], tree)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="a34d16e", help="the commit to compare against")
    ap.add_argument("--new", default=REPO, help="the new tree's path (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--spec", action="store_true",
                    help="speculation off against ngram turned down, both in each tree (the new one, and --spec-old)")
    ap.add_argument("--spec-old", help="with --spec: the same comparison in this commit's tree too")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.num_reqs, args.steps, args.profile, args.spec, args.prompt_len)))
        return
    if args.spec:
        trees = {"new": args.new, **({args.spec_old: old_tree(args.spec_old)} if args.spec_old else {})}
    else:
        trees = {"old": old_tree(args.old), "new": args.new}
    names = list(trees)
    results = {name: [] for name in names}
    for i in range(args.rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            results[name].append(run_child(trees[name], args))
            r = results[name][-1]
            took = (f"off {r['off']['step'] * 1e3:.3f}, ngram {r['ngram']['step'] * 1e3:.3f}" if args.spec
                    else f"{r['step'] * 1e3:.3f}")
            print(f"round {i + 1} {name}: {took} ms/step", file=sys.stderr, flush=True)
    # Columns: one per tree (old, new); with --spec, off and ngram per tree.
    if args.spec:
        runs = {f"{tree} {arm}": [r[arm] for r in results[tree]] for tree in names for arm in ("off", "ngram")}
        ratios = [(f"{tree} ngram", f"{tree} off") for tree in names]
    else:
        runs = results
        ratios = [("new", "old")]
    if args.profile:
        for name, rs in runs.items():
            print(f"==== {name}, top by tottime, then cumulative ====\n{rs[-1]['profile']}")
    rows = ("step", "step_no_gc", *PARTS, "rest", "gc")
    best = {name: {k: min(r[k] for r in rs) for k in (*rows, "calls")} for name, rs in runs.items()}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_step_ab.json"), "w") as f:
            json.dump({"trees": trees, "runs": runs, "best": best}, f, indent=1)
    cols = list(runs)
    print(f"\n{args.num_reqs} decode requests ({args.prompt_len}-token prompts), forward faked; main-thread CPU ms "
          f"per step, best of {args.rounds} rounds of {args.steps} steps; "
          + "; ".join(f"{name} = {tree}" for name, tree in trees.items()))
    print("| part | " + " | ".join(cols) + " | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|---" * (1 + len(cols) + len(ratios)) + "|")
    for k in (*rows, "calls"):
        scale = 1 if k == "calls" else 1e3
        cells = [f"{best[c][k] * scale:.0f}" if k == "calls" else f"{best[c][k] * scale:.3f}" for c in cols]
        quotients = [f"{best[a][k] / best[b][k]:.3f}" if best[b][k] else "nan" for a, b in ratios]
        print(f"| {'Python calls per step' if k == 'calls' else k} | " + " | ".join(cells) + " | "
              + " | ".join(quotients) + " |")
    if args.spec:
        print("| steps that drafted, per round | "
              + " | ".join("/".join(str(r["drafting_steps"]) for r in runs[c]) for c in cols) + " |" * (1 + len(ratios)))


if __name__ == "__main__":
    main()
