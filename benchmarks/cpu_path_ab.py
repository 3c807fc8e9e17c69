"""The CPU path, piece by piece, against HF generate in ONE process (so machine load hits all alike).

Runs the `bench throughput --dataset random` workload (random prompt ids, greedy, ignore_eos) with:
  hf        HF transformers generate, one static batch (as `--baseline hf`)
  new       kvserve as shipped: batched torch attention + oneDNN packed fp32 linears and LM head
  mkl-head  as new, but the LM head (logits GEMM) through plain F.linear
  ref-attn  the per-request reference attention (the pre-issue-13 algorithm), oneDNN linears
  mkl       batched attention, plain F.linear (MKL sgemm) everywhere
  old       reference attention and F.linear
in rounds (variants interleaved), and prints wall and process CPU time, the best of each and its ratio to
HF, and how many outputs equal HF's. CPU time is the steadier reading on a shared machine with
OMP_NUM_THREADS=1; with more threads it also counts OpenMP spin-waiting.

    PYTHONPATH=. python benchmarks/cpu_path_ab.py --num-prompts 32 --input-len 128 --output-len 64 --rounds 2
    PYTHONPATH=. python benchmarks/cpu_path_ab.py --num-prompts 8 --output-len 16 --profile   # op table
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from kvserve.bench.hf_baseline import _generate, load_hf_model
from kvserve.bench.machine import describe
from kvserve.entrypoints.llm import LLM
from kvserve.ops import cpu_gemm
from kvserve.ops import torch_attention as ta
from kvserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="hf,new,mkl-head,ref-attn,mkl,old")
    p.add_argument("--profile", action="store_true", help="torch.profiler op table of one `new` run, then exit")
    a = p.parse_args()

    rng = random.Random(0)
    llm = LLM()
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": [1] * 16}], warm, use_tqdm=False)
    packed = [m for m in gc.get_objects() if isinstance(m, torch.nn.Module) and hasattr(m, "packed_weight")]
    # (module, attribute, its oneDNN value, its plain value): linears swap their method back to the
    # unquantized one, the LM head drops its packed copy (compute_logits then calls F.linear).
    switch = [(m, "quant_method", m.quant_method, m.quant_method.original)
              if isinstance(getattr(m, "quant_method", None), cpu_gemm.PackedUnquantizedMethod)
              else (m, "packed_weight", m.packed_weight, None) for m in packed]
    fast_attention = ta.TorchAttentionBackend.forward

    def kvserve(reference_attention: bool, onednn: bool, onednn_head: bool | None = None):
        ta.TorchAttentionBackend.forward = (
            (lambda self, *args, **kw: ta.reference_attention(*args, **kw)) if reference_attention else fast_attention)
        for m, attr, on, off in switch:
            use = onednn if attr == "quant_method" or onednn_head is None else onednn_head
            setattr(m, attr, on if use else off)
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    if a.profile:
        with torch.profiler.profile() as prof:
            kvserve(False, True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return

    hf_model = load_hf_model(llm.llm_engine.config) if "hf" in a.variants else None

    def hf():
        with torch.no_grad():
            return _generate(hf_model, prompts, a.output_len, "cpu")

    if hf_model is not None:
        with torch.no_grad():
            _generate(hf_model, [[1] * 16], 4, "cpu")
    all_variants = {"hf": hf, "new": lambda: kvserve(False, True), "mkl-head": lambda: kvserve(False, True, False),
                    "ref-attn": lambda: kvserve(True, True),
                    "mkl": lambda: kvserve(False, False), "old": lambda: kvserve(True, False)}
    variants = {k: all_variants[k] for k in a.variants.split(",")}
    print(f"Machine: {describe('cpu')}; {len(packed)} packed linears", flush=True)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    tokens = {}
    for _ in range(a.rounds):
        for name, run in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            tokens[name] = run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            wall_s, cpu_s = times[name][-1]
            print(f"{name:9s} wall {wall_s:8.2f} s  cpu {cpu_s:8.2f} s  load {load}", flush=True)
    base = "hf" if "hf" in variants else next(iter(variants))
    bw, bc = (min(t[i] for t in times[base]) for i in (0, 1))
    ratio = base + "/it"
    print(f"\n{'variant':9s} {'best wall':>10s} {ratio:>8s} {'best cpu':>9s} {ratio:>8s}  same tokens as {base}")
    for name in variants:
        w, c = (min(t[i] for t in times[name]) for i in (0, 1))
        same = sum(x == y for x, y in zip(tokens[name], tokens[base]))
        print(f"{name:9s} {w:9.2f}s {bw / w:7.2f}x {c:8.2f}s {bc / c:7.2f}x  {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
