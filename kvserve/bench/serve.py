"""`kvserve bench serve`: load an OpenAI-compatible server with streamed requests and report vLLM's
serving metrics. Arrivals are a Poisson process (gamma with --burstiness) at --request-rate, optionally
capped at --max-concurrency requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from datetime import datetime
from pathlib import Path

from kvserve.bench.args import add_dataset_args, requests_from_args, write_json
from kvserve.bench.datasets import W1_MIN_VOCAB
from kvserve.bench.metrics import calculate_metrics, format_report, metrics_json
from kvserve.bench.serve_client import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ENDPOINTS,
    RequestSpec,
    build_payload,
    send_request,
)

_TIMEOUT_S = 6 * 3600  # one request may legitimately stream for a long time under heavy load


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Server options")
    g.add_argument("--base-url", default=None, help="Server URL, e.g. http://127.0.0.1:8000 (default: --host/--port).")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", choices=ENDPOINTS, default=COMPLETIONS)
    g.add_argument("--model", default=None, help="Model name sent to the server (default: the first of /v1/models).")
    g.add_argument("--tokenizer", default=None,
                   help="HF directory or .gguf whose tokenizer measures/decodes prompts (default: --model when "
                        "it is a local path, else the embedded SmolLM2's).")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token ($OPENAI_API_KEY).")
    add_dataset_args(p, with_seed=True)
    g = p.add_argument_group("Load options")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second (Poisson arrivals); inf sends them all at once (default).")
    g.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps; 1 is Poisson.")
    g.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at once.")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Send ignore_eos and min_tokens so every reply has its full length (vLLM extensions; "
                        "turn off for servers that reject unknown fields).")
    g.add_argument("--send-token-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="For synthetic datasets on /v1/completions, send prompts as token-id arrays (exact "
                        "lengths); --no-send-token-ids decodes them to text with the tokenizer.")
    g = p.add_argument_group("Output options")
    g.add_argument("--metric-percentiles", default="99", help="Comma-separated percentiles to report (default 99).")
    g.add_argument("--output-json", default=None, help="Write the results (and per-request data) to this file.")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="Save TTFT/ITL distributions and output throughput over time (needs matplotlib).")
    g.add_argument("--disable-tqdm", action="store_true")


def _load_tokenizer(ns, needed: bool):
    from kvserve.model.default_model import find_default_gguf, load_tokenizer

    if ns.tokenizer:
        return load_tokenizer(ns.tokenizer)
    if ns.model and Path(ns.model).expanduser().exists():
        return load_tokenizer(Path(ns.model).expanduser())
    if not needed:
        return None
    print("Using the embedded SmolLM2 tokenizer for prompts; pass --tokenizer for the served model's.")
    return load_tokenizer(find_default_gguf())


def _specs(ns, requests, tokenizer) -> list[RequestSpec]:
    as_ids = ns.endpoint == COMPLETIONS and ns.send_token_ids
    specs = []
    for r in requests:
        prompt = r.prompt
        if not isinstance(prompt, str) and not as_ids:
            prompt = tokenizer.decode(prompt)
        specs.append(RequestSpec(prompt, r.prompt_len, r.expected_output_len))
    return specs


async def _discover_model(client, base: str) -> str:
    import httpx

    try:
        resp = await client.get(f"{base}/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"GET {base}/v1/models failed ({type(e).__name__}: {e}): is the server up?") from e
    if resp.status_code != 200:
        raise ValueError(f"GET {base}/v1/models gave HTTP {resp.status_code}: pass --model.")
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model: pass --model.")
    return data[0]["id"]


async def _arrivals(n: int, rate: float, burstiness: float, seed: int, start: float):
    """Yields request indices at their arrival times, computed from the start so delays never drift."""
    rng = random.Random(seed)
    due = start
    for i in range(n):
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i
        if not math.isinf(rate):
            due += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


async def _benchmark(ns, base: str, specs: list[RequestSpec], count_tokens):
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=ns.max_concurrency, max_keepalive_connections=ns.max_concurrency)
    url = base + ns.endpoint
    async with httpx.AsyncClient(timeout=httpx.Timeout(_TIMEOUT_S, connect=30), limits=limits,
                                 headers=headers) as client:
        model = ns.model or await _discover_model(client, base)

        def payload(spec):
            return build_payload(ns.endpoint, model, spec, ns.ignore_eos)

        # One short request first, as vLLM does: a wrong URL, model name or payload fails here, clearly.
        # (It shares the first prompt, so that request may find its prefix cached: one request in N.)
        probe = RequestSpec(specs[0].prompt, specs[0].prompt_len, min(specs[0].output_len, 4))
        print("Starting initial single prompt test run...")
        test = await send_request(client, url, ns.endpoint, payload(probe), probe, time.perf_counter(), count_tokens)
        if not test.success:
            raise ValueError(f"Initial test run failed against {url} (model {model!r}): {test.error}")
        print("Initial test run completed. Starting main benchmark run...")
        print(f"Traffic request rate: {ns.request_rate}")
        print(f"Burstiness factor: {ns.burstiness}{' (Poisson process)' if ns.burstiness == 1 else ''}")
        print(f"Maximum request concurrency: {ns.max_concurrency}")

        gate = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
        pbar = tqdm(total=len(specs), disable=ns.disable_tqdm)

        async def one(spec, start):
            if gate is None:
                r = await send_request(client, url, ns.endpoint, payload(spec), spec, start, count_tokens)
            else:
                async with gate:
                    r = await send_request(client, url, ns.endpoint, payload(spec), spec, start, count_tokens)
            pbar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(specs), ns.request_rate, ns.burstiness, ns.seed, start):
            tasks.append(asyncio.create_task(one(specs[i], start)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
    return model, list(results), duration


def run(ns: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    if ns.plot:
        from kvserve.bench.plot import check_available

        check_available()  # before a long run, not after it
    if ns.request_rate <= 0 or ns.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0.")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}.")
    percentiles = [float(p) for p in ns.metric_percentiles.split(",") if p.strip()]
    base = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    base = base.removesuffix("/v1")  # OpenAI SDK-style base URLs end in /v1; --endpoint carries it

    needs_text = ns.endpoint == CHAT_COMPLETIONS or not ns.send_token_ids
    tokenizer = _load_tokenizer(ns, needed=ns.dataset != "w1" or needs_text)
    if ns.dataset == "w1" and needs_text and len(tokenizer) < W1_MIN_VOCAB:
        raise ValueError("W1 token ids go up to 119999: decoding them needs a Llama-3-size tokenizer (--tokenizer).")
    requests = requests_from_args(ns, len(tokenizer) if tokenizer is not None else None, tokenizer)
    specs = _specs(ns, requests, tokenizer)
    count_tokens = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer else None

    model, results, duration = asyncio.run(_benchmark(ns, base, specs, count_tokens))
    metrics = calculate_metrics(results, duration, percentiles)
    rate = None if math.isinf(ns.request_rate) else ns.request_rate
    print(format_report(metrics, request_rate=rate, max_concurrency=ns.max_concurrency))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"First error: {errors[0]}")

    if ns.output_json:
        write_json(ns.output_json, {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "base_url": base, "endpoint": ns.endpoint,
            "model_id": model, "dataset": ns.dataset, "num_prompts": len(specs),
            "request_rate": ns.request_rate if rate is not None else "inf", "burstiness": ns.burstiness,
            "max_concurrency": ns.max_concurrency, **metrics_json(metrics),
            "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
        })
    if ns.plot:
        from kvserve.bench.plot import save_plot

        save_plot(results, duration, ns.plot,
                  title=f"{model}, {ns.endpoint}: {len(specs)} requests, request rate {ns.request_rate}/s, "
                        f"max concurrency {ns.max_concurrency or 'unlimited'}")
        print(f"Plot written to {ns.plot}")
    return 0 if metrics.completed else 1
