"""Structured outputs on W1's shape: the cost of a JSON-schema constraint, kvserve against vLLM 0.26.0.

One command on the GPU machine, after the vLLM bundle is unpacked (BENCHMARKS.md: `.vllm/`, two calls) and
xgrammar 0.2.9's wheels are beside it (`.vllm/`, see below):

    bash .vllm/install.sh && PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_structured.py --out $OUT

and here, without a GPU, every part but the GPU ones (a tiny random model on the CPU, 8 requests; vLLM's part
runs in its subprocess and reports itself not run when vllm cannot be imported):

    PYTHONPATH=. python benchmarks/gpu_structured.py --dry-run

The GPU image lacks xgrammar and jsonschema. kvserve needs xgrammar >= 0.2.9 (pyproject.toml; the bundle's
0.2.7 fills this schema's masks tens of times slower): this process unpacks the cp312 wheels of xgrammar and
apache-tvm-ffi found in `.vllm/` (fetched once on the CPU machine with `pip download xgrammar==0.2.9
apache-tvm-ffi==0.1.15.post2 --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_28_x86_64 -d .vllm`) ahead of everything, and takes the rest (jsonschema) from the bundle, after
every package of the image. vLLM runs with its bundle as shipped (its xgrammar 0.2.7); the table names both.
The model is W1's (Llama-3.1-8B shape) with the Llama 3.1 tokenizer saved beside it (`--tokenizer`, default
`.vllm/`; SmolLM2's when it is absent), so both engines mask the full 128,256-token vocabulary. Both engines
load the same weights: one random bf16 safetensors checkpoint of that shape, written on the device once
into --checkpoint-dir (default /tmp/kvserve-w1-random-bf16, about 16 GB; kept for the next run) and read
with load_format auto (`--weights dummy`: each engine's own dummy weights instead, which differ). Both
compile the schema without optional whitespace (vLLM 0.26 reads disable_any_whitespace from its engine's
structured_outputs_config only, not from the request). The 256 W1 prompts, greedy, run:
0. a warm-up: the whole batch with the schema to the end, then without it for WARMUP_TOKENS tokens (the grammar
   compiles, and every kernel shape of the timed runs is compiled before anything is timed: a shorter warm-up
   left the first long run paying for compiles); then REPEATS times 1 and 2:
1. kvserve with the JSON schema (async scheduling, the CUDA default): each request ends when its object closes
   (the schema bounds every string and array, so every output closes well inside max_tokens);
2. kvserve without it, on the same engine, each request given exactly the output length it had in 1
   (ignore_eos): the same batch shapes, so the ratio is the constraint's cost alone;
3. vLLM 0.26.0 with the same schema, the same warm-up and REPEATS runs
   (`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`, xgrammar, the same model
   directory), in a subprocess started after kvserve's engine is freed, so each engine has the GPU to itself.
Every constrained output of both engines is checked with jsonschema. Printed: output tok/s of the three (the
faster of each kind's runs, and every run), each run's output lengths, the ratios against the targets
(constrained >= 0.95x unconstrained kvserve; kvserve constrained >= vLLM constrained), kvserve's per-step host
time filling the bitmask
(StructuredOutputManager.grammar_bitmask; under async scheduling it runs while the next step's forward is on
the GPU) and the GPU time of one bitmask apply on [256, vocab] logits. The table is printed last; results go
to DIR/gpu_structured.json. `--profile` adds the host's time per step phase and the GPU's busy time per step
for both kvserve runs (benchmarks/step_phases.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.vllm_subprocess import VLLM_SITE, run_part, unavailable, write_result

KVSERVE_SITE = "/tmp/kvserve-site"  # xgrammar >= 0.2.9 for kvserve's process, unpacked from .vllm/'s wheels
CHECKPOINT_DIR = "/tmp/kvserve-w1-random-bf16"
WEIGHT_STD = 0.02  # HF's Llama initializer range
MAX_MODEL_LEN = 4096
MAX_TOKENS = 2048  # far above the schema's longest object: every constrained output closes
DRY_RUN_PROMPTS, DRY_RUN_PROMPT_LEN = 8, 48
TARGET_VS_UNCONSTRAINED, TARGET_VS_VLLM = 0.95, 1.0
WARMUP_TOKENS, REPEATS = 16, 2  # every timed run is preceded by a whole-batch warm-up; each kind runs REPEATS times
PROFILE_FIRST_STEP, PROFILE_STEPS = 40, 20  # --profile's GPU window: decode steps, past the prefills

# An extraction-shaped object whose every string and array is bounded, so its length is too.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "minLength": 4, "maxLength": 48},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 16},
                 "minItems": 1, "maxItems": 6},
        "lines": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "note": {"type": "string", "maxLength": 32}},
            "required": ["sku", "qty", "note"], "additionalProperties": False}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "tags", "lines", "address", "verified"],
    "additionalProperties": False,
}


# ---- the model and the requests -----------------------------------------------------------------------------
def default_tokenizer_dir() -> str | None:
    return ".vllm" if os.path.exists(os.path.join(".vllm", "tokenizer.json")) else None


def model_dir(tokenizer_dir: str | None, dry_run: bool, weights: str = "checkpoint",
              checkpoint_dir: str = CHECKPOINT_DIR) -> tuple[str, str]:
    """(a model directory with a tokenizer beside the weights' config, the tokenizer's name). With
    weights="checkpoint" the directory holds the random checkpoint both engines load (written once)."""
    from kvserve.model.default_model import find_default_gguf, load_tokenizer

    if dry_run:
        return tiny_model_dir(), "SmolLM2 (tiny random model)"
    from kvserve.bench.datasets import write_w1_config

    path = checkpoint_dir if weights == "checkpoint" else tempfile.mkdtemp(prefix="kvserve-w1-")
    os.makedirs(path, exist_ok=True)
    write_w1_config(path)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
        name = f"Llama 3.1 ({tokenizer_dir})"
    else:
        load_tokenizer(find_default_gguf()).save_pretrained(path)
        name = "SmolLM2 (no Llama 3.1 tokenizer found: its vocabulary is masked beyond 49,152)"
    if weights == "checkpoint":
        write_random_checkpoint(path, "cuda")
    return path, name


def write_random_checkpoint(path: str, device: str, seed: int = 0, shard_bytes: int = 4 << 30) -> float:
    """Random bf16 weights for the config in `path` as HF safetensors shards (with their index), unless a
    complete set is there already; the seconds it took. Every tensor is drawn on `device` from one seeded
    generator: normal(0, WEIGHT_STD), norms ones."""
    import transformers
    from safetensors.torch import save_file

    done = os.path.join(path, "random-weights.done")
    if os.path.exists(done):
        print(f"== weights: {path} (written before)", flush=True)
        return 0.0
    t0 = time.perf_counter()
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    shards, size = [[]], 0  # the tensor names of each shard
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                t = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                t = (torch.randn(shapes[name], generator=gen, device=device) * WEIGHT_STD).to(torch.bfloat16).cpu()
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    open(done, "w").close()
    seconds = time.perf_counter() - t0
    print(f"== weights: {total / 1e9:.1f} GB of random bf16 in {len(shards)} shards written to {path} in "
          f"{seconds:.0f} s", flush=True)
    return seconds


def tiny_model_dir() -> str:
    """A random 2-layer Llama with SmolLM2's tokenizer (the test suite's tiny model), for --dry-run; its weights
    come from the same writer as the GPU run's checkpoint."""
    import transformers

    from kvserve.model.default_model import find_default_gguf, load_tokenizer

    tokenizer = load_tokenizer(find_default_gguf())
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
    path = tempfile.mkdtemp(prefix="kvserve-structured-tiny-")
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    write_random_checkpoint(path, "cpu")
    return path


def requests(num_prompts: int, dry_run: bool) -> list[list[int]]:
    """W1's prompts (W1's ids fit the 128k vocabulary); in a dry run a few short ones."""
    from kvserve.bench.datasets import w1_requests

    prompts = [r.prompt_token_ids for r in w1_requests(num_prompts)]
    if dry_run:
        prompts = [[100 + t % 40000 for t in p[:DRY_RUN_PROMPT_LEN]] for p in prompts[:DRY_RUN_PROMPTS]]
    return prompts


def validate(texts: list[str]) -> tuple[int, list[str]]:
    """(outputs that validate against SCHEMA, the first few problems)."""
    import jsonschema

    valid, problems = 0, []
    for text in texts:
        try:
            # strict=False: xgrammar lets a length-bounded string hold raw control characters
            jsonschema.validate(json.loads(text, strict=False), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"{type(e).__name__}: {str(e)[:120]} in {text[:80]!r}")
    return valid, problems[:3]


def use_bundle_libraries(wheel_dir: str = ".vllm") -> str:
    """kvserve's xgrammar (>= 0.2.9) from the wheels in `wheel_dir`, ahead of everything; jsonschema (and the
    xgrammar wheels' own dependencies) from the vLLM bundle, after every package of the image (the bundle
    holds no torch or transformers). Returns the xgrammar version in use."""
    import glob
    import zipfile

    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = [w for name in ("xgrammar", "apache_tvm_ffi")
              for w in sorted(glob.glob(os.path.join(wheel_dir, f"{name}-*-{tag}-*.whl")))[-1:]]
    if wheels:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(KVSERVE_SITE)
        sys.path.insert(0, KVSERVE_SITE)
    if os.path.isdir(VLLM_SITE) and VLLM_SITE not in sys.path:
        sys.path.append(VLLM_SITE)
    try:
        import jsonschema  # noqa: F401
        import xgrammar  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{e}: kvserve's structured outputs need xgrammar (and this check jsonschema); unpack "
                         f"the vLLM bundle first (bash .vllm/install.sh), which has jsonschema") from None
    import importlib.metadata

    from kvserve.structured_output import backend_xgrammar

    if backend_xgrammar.version() < backend_xgrammar.MIN_VERSION:
        raise SystemExit(f"xgrammar {importlib.metadata.version('xgrammar')} found ({xgrammar.__file__}); kvserve "
                         f"needs >= {'.'.join(map(str, backend_xgrammar.MIN_VERSION))}. Put its {tag} wheels in "
                         f"{wheel_dir}/ (the docstring has the pip download command).")
    return importlib.metadata.version("xgrammar")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- kvserve --------------------------------------------------------------------------------------------------
def run_kvserve(path: str, prompts: list[list[int]], device: str, weights: str = "checkpoint",
                profile: bool = False) -> dict:
    """After a whole-batch warm-up, REPEATS times: the constrained run, then the unconstrained one with each
    request's length from it; one engine. The faster run of each kind is reported, beside every run.
    `profile`: then both again under profile_passes."""
    from kvserve import LLM, SamplingParams, StructuredOutputsParams

    # xgrammar, as vLLM's auto picks for this schema (and llguidance is not loaded for nothing).
    kwargs = dict(max_model_len=MAX_MODEL_LEN, structured_outputs_config='{"backend": "xgrammar"}')
    if device == "cuda":
        kwargs.update(load_format="dummy" if weights == "dummy" else "auto", dtype="bfloat16")
    else:
        kwargs.update(kv_cache_memory_bytes=64 << 20)
    t0 = time.perf_counter()
    llm = LLM(path, **kwargs)
    engine = llm.llm_engine
    init_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    mask_times: list[tuple[float, int]] = []  # (seconds, rows) per step that had constrained rows
    fill = engine.structured_output.grammar_bitmask

    def timed_fill(scheduled):
        t = time.perf_counter()
        bitmask, rows = fill(scheduled)
        if bitmask is not None:
            mask_times.append((time.perf_counter() - t, bitmask.shape[0]))
        return bitmask, rows

    engine.structured_output.grammar_bitmask = timed_fill
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    constrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False,
                                 structured_outputs=constraint)
    batch = [{"prompt_token_ids": p} for p in prompts]
    try:
        # Warm-up, untimed: the whole constrained run, so the grammar compiles (then cached) and the kernels of every
        # shape the timed runs meet (batch 256, 256 mask rows, the longest contexts) compile before anything is
        # timed; then the unconstrained kind once, shorter.
        llm.generate(batch, constrained, use_tqdm=False)
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        runs = []
        for _ in range(REPEATS):  # alternating, so drift over the runs does not favour one kind
            mask_times.clear()
            with_schema, lengths = timed_constrained(llm, batch, constrained, tokenizer, device)
            with_schema.update(mask_stats(mask_times))
            free_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                           for n in lengths]
            without = timed_unconstrained(llm, batch, free_params, sum(lengths), device)
            runs.append((with_schema, without))
        vocab = engine.config.model_config.vocab_size
        profiles = profile_passes(llm, batch, constrained, free_params, device) if profile else None
    finally:
        engine.shutdown()
        del llm, engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"init_s": init_s, "vocab_size": vocab, "constrained": max((c for c, _ in runs), key=_rate),
            "unconstrained": max((u for _, u in runs), key=_rate), "runs": runs, "profile": profiles}


def _rate(run: dict) -> float:
    return run["tokens_per_s"]


def _timed(llm, batch, params, device: str) -> tuple[list, float]:
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    _sync(device)
    return outs, time.perf_counter() - t0


def timed_constrained(llm, batch, params, tokenizer, device: str) -> tuple[dict, list[int]]:
    """One timed run with the schema, checked with jsonschema; (its figures, each output's length)."""
    outs, seconds = _timed(llm, batch, params, device)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid, problems = validate([tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs])
    return {"seconds": seconds, "output_tokens": sum(lengths), "tokens_per_s": sum(lengths) / seconds,
            "lengths": length_stats(lengths), "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs),
            "valid": valid, "num_requests": len(outs), "problems": problems}, lengths


def timed_unconstrained(llm, batch, params, expected_tokens: int, device: str) -> dict:
    """One timed run without the schema, each request held to its constrained run's length."""
    outs, seconds = _timed(llm, batch, params, device)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert sum(lengths) == expected_tokens, (sum(lengths), expected_tokens)
    return {"seconds": seconds, "output_tokens": sum(lengths), "tokens_per_s": sum(lengths) / seconds,
            "lengths": length_stats(lengths)}


def mask_stats(mask_times: list[tuple[float, int]]) -> dict:
    """The host's bitmask fill per step: mean and p99 milliseconds, mean rows."""
    if not mask_times:
        return {}
    per_step = sorted(t for t, _ in mask_times)
    return {"mask_steps": len(per_step), "mask_ms_mean": 1e3 * statistics.mean(per_step),
            "mask_ms_p99": 1e3 * per_step[int(0.99 * (len(per_step) - 1))],
            "mask_rows_mean": statistics.mean(r for _, r in mask_times)}


def profile_passes(llm, batch, constrained, free_params, device: str) -> dict:
    """Both runs again, each twice: once with the host's time per step phase (benchmarks/step_phases.py), once
    with the GPU profiled over PROFILE_STEPS steps of its decode (busy vs wall per step, top kernels)."""
    from benchmarks.step_phases import StepPhases, gpu_window

    engine, result = llm.llm_engine, {}
    for name, params in (("constrained", constrained), ("unconstrained", free_params)):
        phases = StepPhases(engine)
        try:
            llm.generate(batch, params, use_tqdm=False)
        finally:
            phases.remove()
        result[name] = {"host": phases.report()}
        if device == "cuda":
            window: dict = {}
            with gpu_window(engine, PROFILE_FIRST_STEP, PROFILE_STEPS, window):
                llm.generate(batch, params, use_tqdm=False)
            result[name]["gpu"] = window
    return result


def length_stats(lengths: list[int]) -> dict:
    return {"mean": statistics.mean(lengths), "min": min(lengths), "max": max(lengths)} if lengths else {}


def apply_ms(vocab: int, device: str, rows: int = 256) -> float:
    """Milliseconds of one bitmask apply on [rows, vocab] float32 logits (kvserve's apply function)."""
    from kvserve.structured_output.bitmask import apply_token_bitmask

    logits = torch.randn(rows, vocab, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32)
    all_rows = list(range(rows))
    for _ in range(3):
        apply_token_bitmask(logits, bitmask, all_rows)
    iters = 20
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        apply_token_bitmask(logits, bitmask, all_rows)
    _sync(device)
    return 1e3 * (time.perf_counter() - t0) / iters


# ---- vLLM (its own process) -----------------------------------------------------------------------------------
def run_vllm_subprocess(path: str, num_prompts: int, dry_run: bool, result_file: str,
                        weights: str = "checkpoint") -> dict:
    """This script again with --part vllm (benchmarks/vllm_subprocess.py)."""
    return run_part(__file__, ["--part", "vllm", "--model-dir", path, "--num-prompts", str(num_prompts),
                               "--weights", weights] + (["--dry-run"] if dry_run else []), result_file)


def vllm_part(args) -> None:
    """Inside the subprocess: vLLM with the same schema, prompts and model directory."""
    reason = unavailable(args.dry_run)
    if reason is not None:
        write_result(args.result_file, {"not_run": reason})
        return
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = requests(args.num_prompts, dry_run=False)
    t0 = time.perf_counter()
    # disable_any_whitespace is the engine's: vLLM 0.26's xgrammar backend ignores the request's field.
    llm = LLM(model=args.model_dir, load_format="dummy" if args.weights == "dummy" else "auto", dtype="bfloat16",
              gpu_memory_utilization=0.90, max_model_len=MAX_MODEL_LEN, seed=0,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, params, use_tqdm=False)  # warm-up as kvserve's: the whole constrained run, untimed
    seconds = float("inf")
    all_seconds = []
    for _ in range(REPEATS):  # the faster run counts, as for kvserve
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run = llm.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize()
        all_seconds.append(time.perf_counter() - t0)
        if all_seconds[-1] < seconds:
            seconds, outs = all_seconds[-1], run
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    num_out = sum(lengths)
    valid, problems = validate([o.outputs[0].text for o in outs])
    import importlib.metadata

    write_result(args.result_file, {
        "vllm_version": vllm.__version__, "xgrammar": importlib.metadata.version("xgrammar"), "init_s": init_s,
        "seconds": seconds, "all_seconds": all_seconds, "output_tokens": num_out, "lengths": length_stats(lengths),
        "tokens_per_s": num_out / seconds, "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs),
        "valid": valid, "num_requests": len(outs), "problems": problems})


# ---- the table ------------------------------------------------------------------------------------------------
def print_table(result: dict) -> None:
    from benchmarks.step_phases import format_phases

    ours, theirs = result["kvserve"], result["vllm"]
    free, constrained = ours["unconstrained"], ours["constrained"]
    print(f"\n{result['device']}: W1 prompts ({result['num_prompts']}), greedy, JSON schema; tokenizer "
          f"{result['tokenizer']}; weights: {result.get('weights', '?')}; xgrammar: kvserve "
          f"{ours.get('xgrammar', '?')}, vLLM {theirs.get('xgrammar', '-')}")
    print(f"{'run':30} {'out tok':>8} {'len mean (min-max)':>19} {'s':>7} {'tok/s':>9} {'stop':>5} {'valid':>8} "
          f"{'mask ms/step':>18}")
    mask = (f"{constrained['mask_ms_mean']:.2f} (p99 {constrained['mask_ms_p99']:.2f})"
            if "mask_ms_mean" in constrained else "-")
    rows = [("kvserve, no constraint", free, "-", "-", "-"),
            ("kvserve, JSON schema", constrained, constrained["finished_stop"],
             f"{constrained['valid']}/{constrained['num_requests']}", mask)]
    if "not_run" not in theirs:
        rows.append((f"vLLM {theirs['vllm_version']}, JSON schema", theirs, theirs["finished_stop"],
                     f"{theirs['valid']}/{theirs['num_requests']}", "-"))
    for name, r, stop, valid, m in rows:
        lengths = r.get("lengths") or {}
        length = f"{lengths['mean']:.0f} ({lengths['min']}-{lengths['max']})" if lengths else "-"
        print(f"{name:30} {r['output_tokens']:8d} {length:>19} {r['seconds']:7.2f} {r['tokens_per_s']:9.0f} "
              f"{stop!s:>5} {valid:>8} {m:>18}")
    runs = ours.get("runs") or []
    if len(runs) > 1:
        print("every run, tok/s: kvserve constrained " + " / ".join(f"{c['tokens_per_s']:.0f}" for c, _ in runs)
              + ", unconstrained " + " / ".join(f"{u['tokens_per_s']:.0f}" for _, u in runs)
              + (", vLLM " + " / ".join(f"{theirs['output_tokens'] / t:.0f}" for t in theirs["all_seconds"])
                 if "all_seconds" in theirs else ""))
    if "not_run" in theirs:
        print(f"vLLM: not run ({theirs['not_run']})")
    for name, ratio, target in [("constrained / unconstrained kvserve", result["ratio_vs_unconstrained"],
                                 TARGET_VS_UNCONSTRAINED),
                                ("kvserve constrained / vLLM constrained", result.get("ratio_vs_vllm"), TARGET_VS_VLLM)]:
        verdict = "not run" if ratio is None else f"{ratio:.3f}x ({'met' if ratio >= target else 'MISSED'})"
        print(f"{name:40} {verdict}   target >= {target:.2f}x")
    print(f"bitmask apply, 256 rows x {ours['vocab_size']}: {result['apply_ms_256_rows']:.3f} ms on the "
          f"{'GPU' if result['device_type'] == 'cuda' else 'CPU'}")
    for name, prof in (ours.get("profile") or {}).items():
        print(f"profile, {name}: host {format_phases(prof['host'])}")
        gpu = prof.get("gpu")
        if gpu and gpu.get("steps"):
            kernels = "; ".join(f"{k} {ms:.2f}" for k, ms in gpu["top_kernels"][:5])
            print(f"profile, {name}: GPU busy {gpu['busy_ms']:.2f} of {gpu['wall_ms']:.2f} ms wall per step over "
                  f"{gpu['steps']} steps; top kernels (ms/step): {kernels}")
    invalid = [(n, r["problems"]) for n, r in [("kvserve", constrained), ("vLLM", theirs)]
               if r.get("problems")]
    for name, problems in invalid:
        print(f"{name}: outputs that do not validate, e.g. {problems[0]}")


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json and tokenizer_config.json "
                    "(default: .vllm/ when it has them, else SmolLM2's)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--weights", choices=["checkpoint", "dummy"], default="checkpoint",
                    help="checkpoint: one random bf16 checkpoint both engines load (written once to "
                         "--checkpoint-dir); dummy: each engine's own dummy weights (they differ)")
    ap.add_argument("--checkpoint-dir", default=CHECKPOINT_DIR)
    ap.add_argument("--checkpoint-only", action="store_true",
                    help="write the checkpoint (if it is not there yet) and stop: a device call of its own")
    ap.add_argument("--profile", action="store_true",
                    help="then both kvserve runs again: host time per step phase and the GPU's busy time per step")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: a tiny random model on the CPU, 8 requests")
    ap.add_argument("--part", choices=["all", "vllm"], default="all", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part == "vllm":
        vllm_part(args)
        return None
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or here with --dry-run")
    xgrammar_version = use_bundle_libraries()
    tokenizer_dir = args.tokenizer or default_tokenizer_dir()
    weights = "checkpoint" if args.dry_run else args.weights
    path, tokenizer_name = model_dir(tokenizer_dir, args.dry_run, weights, args.checkpoint_dir)
    if args.checkpoint_only:
        return None
    try:
        prompts = requests(args.num_prompts, args.dry_run)
        ours = run_kvserve(path, prompts, device, weights, args.profile)
        ours["xgrammar"] = xgrammar_version
        if args.skip_vllm:
            theirs = {"not_run": "--skip-vllm"}
        else:
            theirs = run_vllm_subprocess(path, args.num_prompts, args.dry_run,
                                         os.path.join(tempfile.mkdtemp(prefix="kvserve-structured-"), "vllm.json"),
                                         weights)
    finally:
        if path != args.checkpoint_dir:  # the shared checkpoint stays for the next run
            shutil.rmtree(path, ignore_errors=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)", "device_type": device,
              "weights": ("one random bf16 checkpoint, both engines" if weights == "checkpoint"
                          else "each engine's dummy weights"),
              "num_prompts": len(prompts), "tokenizer": tokenizer_name, "schema": SCHEMA, "kvserve": ours,
              "vllm": theirs, "apply_ms_256_rows": apply_ms(ours["vocab_size"], device),
              "ratio_vs_unconstrained": ours["constrained"]["tokens_per_s"] / ours["unconstrained"]["tokens_per_s"],
              "ratio_vs_vllm": (ours["constrained"]["tokens_per_s"] / theirs["tokens_per_s"]
                                if "tokens_per_s" in theirs else None)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_structured.json"), "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
