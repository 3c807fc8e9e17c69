"""`kvserve tune MODEL --dataset ... [--budget-minutes N] [--slo-ttft-ms X]`: short offline benchmarks in
the tuning order, then the table of what was tried and the best command line.

The order is the one memory problems are solved in: first a max_model_len that fits (the dataset's longest
request, which `kvserve plan`'s arithmetic must fit), then KV headroom (--gpu-memory-utilization, on GPUs),
then the batch: a coarse grid of --max-num-seqs x --max-num-batched-tokens, then a finer one around the best.
"Best" is the highest output throughput, or with --slo-ttft-ms the highest among trials whose p90 time to
first token (all requests submitted at once) meets the SLO. Every trial is appended to --results as one
JSON line; a rerun with the same file skips what was already measured, and Ctrl-C prints what was found.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path

from kvserve.bench.args import add_dataset_args, requests_from_args
from kvserve.bench.datasets import W1_MODEL_ALIAS
from kvserve.bench.engine_setup import add_model_args, bench_engine_args
from kvserve.config import DEFAULT_BLOCK_SIZE

TUNED = ("max_model_len", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")
COARSE_SEQS = (32, 64, 128, 256, 512)
COARSE_TOKENS = (2048, 8192, 16384)
UTILIZATIONS = (0.9, 0.95)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="Model (or use --model).")
    add_model_args(p)
    add_dataset_args(p, with_seed=False)
    g = p.add_argument_group("Tune options")
    g.add_argument("--budget-minutes", type=float, default=10.0, help="Stop starting trials after this long.")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="Best = highest throughput with p90 TTFT under this.")
    g.add_argument("--max-trials", type=int, default=None, help="Stop after this many trials.")
    g.add_argument("--results", default=None, help="JSON-lines file of trials: appended to, and read to resume.")
    g.add_argument("--disable-tqdm", action="store_true")


@dataclasses.dataclass
class Trial:
    settings: dict  # the TUNED engine flags
    stage: str
    output_tokens_per_second: float | None = None
    tokens_per_second: float | None = None
    ttft_p90_ms: float | None = None
    num_preemptions: int | None = None
    elapsed: float | None = None
    error: str | None = None
    wall_s: float | None = None  # the whole trial, engine start included: what the budget is spent on

    @property
    def key(self) -> str:
        return json.dumps(self.settings, sort_keys=True)

    def meets(self, slo_ms: float | None) -> bool:
        return self.error is None and (slo_ms is None or (self.ttft_p90_ms or math.inf) <= slo_ms)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def run_trial(engine_args, settings: dict, requests, stage: str) -> Trial:
    """One short offline benchmark with these settings; a start-up or runtime failure is a result too."""
    from kvserve.bench.throughput import run_kvserve

    trial = Trial(dict(settings), stage)
    started = time.monotonic()
    try:
        elapsed, outputs, _ = run_kvserve(dataclasses.replace(engine_args, **settings), requests, False, False)
    except (ValueError, RuntimeError) as e:  # does not fit (StartupMemoryError), or ran out of memory
        trial.error = f"{type(e).__name__}: {str(e)[:300]}"
        return trial
    finally:
        _release_device_memory()
        trial.wall_s = round(time.monotonic() - started, 2)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    all_tokens = out_tokens + sum(len(o.prompt_token_ids) for o in outputs)
    ttfts = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1e3 for o in outputs
             if o.metrics and o.metrics.first_token_time is not None]
    trial.output_tokens_per_second = out_tokens / elapsed
    trial.tokens_per_second = all_tokens / elapsed
    trial.ttft_p90_ms = _percentile(ttfts, 0.9) if ttfts else None
    trial.num_preemptions = sum(o.num_preemptions for o in outputs)
    trial.elapsed = elapsed
    return trial


def _release_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Tuner:
    def __init__(self, ns, engine_args, requests, on_gpu: bool, results_path: str | None):
        self.ns, self.engine_args, self.requests, self.on_gpu = ns, engine_args, requests, on_gpu
        self.trials: list[Trial] = []
        self.done: dict[str, Trial] = {}
        self.results_path = Path(results_path) if results_path else None
        self.started = time.monotonic()
        self.budget = ns.budget_minutes * 60
        self.num_run = 0
        # A resumed run has already spent the wall time of the trials it reads: the budget is for the whole tuning.
        self.spent_before = 0.0
        self.num_before = 0
        if self.results_path and self.results_path.exists():
            for line in self.results_path.read_text().splitlines():
                if line.strip():
                    t = Trial(**json.loads(line))
                    self.done[t.key] = t
                    self.spent_before += t.wall_s or 0.0
                    self.num_before += 1
            print(f"Resuming: {len(self.done)} trials read from {self.results_path} "
                  f"({self.spent_before / 60:.1f} of the {self.budget / 60:g} budget minutes already spent)")

    def spent(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    # ---- running -----------------------------------------------------------------------------------
    def out_of_budget(self) -> bool:
        if self.ns.max_trials is not None and self.num_run >= self.ns.max_trials:
            return True
        runs = self.num_run + self.num_before
        mean = self.spent() / runs if runs else 0
        return self.spent() + mean > self.budget

    def measure(self, settings: dict, stage: str) -> Trial | None:
        trial = Trial(dict(settings), stage)
        if trial.key in self.done:
            trial = self.done[trial.key]
        else:
            if self.out_of_budget():
                return None
            trial = run_trial(self.engine_args, settings, self.requests, stage)
            self.num_run += 1
            self.done[trial.key] = trial
            if self.results_path:
                with self.results_path.open("a") as f:
                    f.write(json.dumps(dataclasses.asdict(trial)) + "\n")
        if all(t.key != trial.key for t in self.trials):
            self.trials.append(trial)
        self._progress(trial)
        return trial

    def _progress(self, t: Trial) -> None:
        if self.ns.disable_tqdm:
            return
        spent = self.spent()
        filled = min(30, int(30 * spent / self.budget)) if self.budget else 30
        bar = "#" * filled + "." * (30 - filled)
        what = t.error.split(":")[0] if t.error else f"{t.output_tokens_per_second:,.1f} out tok/s"
        print(f"[{bar}] {spent / 60:4.1f}/{self.budget / 60:.1f} min  {t.stage:<12} {_flags(t.settings)} -> {what}",
              file=sys.stderr, flush=True)

    def best(self, stage: str | None = None) -> Trial | None:
        ok = [t for t in self.trials if t.meets(self.ns.slo_ttft_ms) and (stage is None or t.stage == stage)]
        return max(ok, key=lambda t: t.output_tokens_per_second, default=None)

    # ---- the tuning order -----------------------------------------------------------------------------
    def run(self) -> None:
        args = self.engine_args
        needed = max(r.prompt_len + r.expected_output_len for r in self.requests)
        bs = args.block_size or DEFAULT_BLOCK_SIZE  # the engine may choose a larger one (config.default_block_size)
        length = args.max_model_len or -(-needed // 256) * 256
        base = {"max_model_len": length, "gpu_memory_utilization": args.gpu_memory_utilization,
                "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
        # 1. the length: the dataset's longest request must fit; shorter would reject requests.
        first = self.measure(base, "length")
        if first is None:
            return
        if first.error and "--max-model-len" in first.error:
            base["max_model_len"] = max(-(-needed // bs) * bs, bs)
            first = self.measure(base, "length")
            if first is None or first.error:
                return
        # 2. KV headroom (GPU only: on CPU the KV cache is --kv-cache-memory-bytes).
        if self.on_gpu and args.kv_cache_memory_bytes is None and args.num_gpu_blocks_override is None:
            for util in UTILIZATIONS:
                if util != base["gpu_memory_utilization"] and self.measure({**base, "gpu_memory_utilization": util},
                                                                           "utilization") is None:
                    return
            best = self.best("utilization") or self.best("length")
            if best:
                base["gpu_memory_utilization"] = best.settings["gpu_memory_utilization"]
        # 3. the batch, coarse then fine.
        n = len(self.requests)
        seqs = sorted({min(s, n) for s in COARSE_SEQS})
        for s in seqs:
            for tokens in COARSE_TOKENS:
                if tokens >= s and self.measure({**base, "max_num_seqs": s, "max_num_batched_tokens": tokens},
                                                "coarse") is None:
                    return
        best = self.best()
        if best is None:
            return
        s0, t0 = best.settings["max_num_seqs"], best.settings["max_num_batched_tokens"] or 8192
        for s in sorted({max(1, int(s0 * 0.75)), s0, int(s0 * 1.5)}):
            for tokens in sorted({int(t0 * 0.75), t0, int(t0 * 1.5)}):
                if tokens >= s and self.measure({**best.settings, "max_num_seqs": s,
                                                 "max_num_batched_tokens": tokens}, "fine") is None:
                    return

    # ---- the report ------------------------------------------------------------------------------------
    def report(self, model: str, interrupted: bool = False) -> str:
        header = (f"{'stage':<12}{'max_model_len':>14}{'gpu_util':>9}{'max_num_seqs':>13}{'batched_tokens':>15}"
                  f"{'out tok/s':>11}{'tok/s':>10}{'p90 TTFT ms':>12}{'preempt':>8}  result")
        lines = [("Interrupted: the trials so far" if interrupted else "Trials") + f" ({len(self.trials)}):", header]
        for t in self.trials:
            s = t.settings
            if t.error:
                cells = f"{'-':>11}{'-':>10}{'-':>12}{'-':>8}  {t.error[:60]}"
            else:
                ok = "ok" if t.meets(self.ns.slo_ttft_ms) else "misses SLO"
                cells = (f"{t.output_tokens_per_second:>11,.1f}{t.tokens_per_second:>10,.1f}"
                         f"{t.ttft_p90_ms or 0:>12,.1f}{t.num_preemptions:>8}  {ok}")
            lines.append(f"{t.stage:<12}{s['max_model_len']:>14}{s['gpu_memory_utilization']:>9}{s['max_num_seqs']:>13}"
                         f"{str(s['max_num_batched_tokens']):>15}{cells}")
        best = self.best()
        goal = f"under p90 TTFT {self.ns.slo_ttft_ms:g} ms" if self.ns.slo_ttft_ms else "for throughput"
        if best is None:
            lines.append(f"No trial succeeded {goal}.")
        else:
            default = next((t for t in self.trials if t.stage == "length" and not t.error), None)
            gain = (f" ({best.output_tokens_per_second / default.output_tokens_per_second:.2f}x the first trial)"
                    if default else "")
            lines.append(f"Best {goal}: {best.output_tokens_per_second:,.1f} output tok/s{gain}")
            lines.append(" ".join(filter(None, ["kvserve serve", model, _flags(best.settings)])))
        return "\n".join(lines)


def _flags(settings: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items() if v is not None)


def run(ns: argparse.Namespace) -> int:
    if ns.model_pos is not None:
        ns.model = ns.model_pos
    with bench_engine_args(ns, ns.dataset) as engine_args:
        config = engine_args.create_engine_config()
        tokenizer = None
        if ns.dataset == "sharegpt" and not engine_args.skip_tokenizer_init:
            from kvserve.model.default_model import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer_path)
        requests = requests_from_args(ns, config.model_config.vocab_size, tokenizer)
        tuner = Tuner(ns, engine_args, requests, config.device == "cuda", ns.results)
        # No model: the embedded default one, or with --dataset w1 a directory holding W1's config (dummy weights).
        w1 = ns.model in (None, W1_MODEL_ALIAS) and ns.dataset == "w1"
        model = "W1_CONFIG_DIR --load-format dummy" if w1 else (ns.model or "")
        try:
            tuner.run()
        except KeyboardInterrupt:
            print(tuner.report(model, interrupted=True))
            return 130
    print(tuner.report(model))
    return 0
