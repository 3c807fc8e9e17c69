"""AsyncEngine: many concurrent asyncio callers streaming from one engine whose step loop runs elsewhere.

Why not on the event loop: a step takes tens of milliseconds; run there it would stall every HTTP
connection, and every HTTP callback would in turn delay the next step. So the step loop (EngineCore) runs
in a process of its own by default, as vLLM's does: its Python work (scheduling, inputs, detokenization)
never waits for this process's GIL, which HTTP, JSON and tokenization hold. Measured on the tiny model,
where a step is mostly Python, a thread in this process made served throughput about half of offline.
A thread (use_process=False) remains for tests and embedding.

The two sides share nothing mutable but two channels:
  asyncio -> engine   a queue of commands (add, abort, stop), batched into one pipe message per wake-up
                      and applied between steps; the core blocks on it only while it has no work.
  engine -> asyncio   one EngineBatch per iteration (accepted adds, outputs, stats), received by a thread
                      and handed to the event loop with one call_soon_threadsafe, then fanned out to
                      per-request streams.
A stream read more slowly than the engine produces merges the DELTA outputs waiting in it, so a slow
client costs one bigger chunk rather than a growing backlog (as vLLM's RequestOutputCollector).

Liveness: a dead engine process is seen at once (its sentinel); a stopped or hung one is not, so the
event loop pings the core every HEARTBEAT_INTERVAL_S and `seconds_since_heard()` says how long ago the
last batch (a step's, or a ping's answer) arrived. The server's /health turns that into a 503.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import multiprocessing.util
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator

from kvserve.background import in_background
from kvserve.config import EngineArgs, EngineConfig
from kvserve.engine.engine_core import PING, STOP, EngineBatch, EngineCore, run_engine_core_process
from kvserve.engine.metrics import EngineMetrics, FinishedRequest
from kvserve.inputs import parse_prompt
from kvserve.request_limits import ValidatedPrompt
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0


class EngineNotReadyError(RuntimeError):
    """The model is still loading, or the engine is shutting down."""


class EngineFailedError(RuntimeError):
    """A step failed; the requests in it were aborted (the engine itself keeps running)."""


class EngineDeadError(EngineFailedError):
    """The engine core (process or thread) is gone: nothing more can be served (vLLM's EngineDeadError)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: try again later (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestAbortedError(RuntimeError):
    """The request was aborted while someone was still reading its stream."""


class RequestStream:
    """One request's outputs on their way from the engine to their consumer (event-loop side only)."""

    def __init__(self, request_id: str, kind: RequestOutputKind, arrival: float, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None, num_sequences: int = 1):
        self.request_id = request_id
        self.num_sequences = num_sequences  # n: the engine runs one sequence per sample
        self.kind = kind
        self.arrival = arrival
        # Outputs from an engine process arrive without these (see ProcessOutbox): they are put back here.
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False  # nothing more will come from the engine
        self._delivered_final = False
        # The engine's token counts (RequestMetrics) already added to the counters: prompt, generated.
        self.counted = (0, 0)

    def put(self, out: RequestOutput) -> None:
        if self._pending is not None and self.kind == RequestOutputKind.DELTA:
            _merge_delta(self._pending, out)
        else:
            self._pending = out
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        if not self.accepted.done():
            self.accepted.set_exception(error)
            self.accepted.exception()  # retrieved: no "never retrieved" warning if nobody awaits it
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._pending is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._pending is not None:  # deliver what was produced before an error
            out, self._pending = self._pending, None
            return out
        raise self._error

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._delivered_final:
            raise StopAsyncIteration
        out = await self.get()
        self._delivered_final = out.finished
        return out


def _stop_process(process, timeout: float) -> None:
    """Waits up to `timeout` for a process asked to stop, then kills it; either way it is reaped."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Appends a later DELTA output to an unread one (both own their lists: the engine made them fresh)."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs


class AsyncEngine:
    """`use_process=True` (the server's choice) runs the EngineCore in a child process; False runs it on a
    thread of this process (quicker to start; for tests and embedding)."""

    def __init__(self, args: EngineArgs | EngineConfig, metrics: EngineMetrics | None = None,
                 use_process: bool = True, max_waiting_sequences: int | None = None):
        """`args`: an EngineConfig already resolved (the server's), or EngineArgs resolved at start() on this
        process's loading thread. Either way the engine core is handed the resolved config, never resolving
        it again. `max_waiting_sequences`: most sequences that may wait beyond the engine's --max-num-seqs; a
        batch that would queue more is refused with EngineOverloadedError. None: no bound (the library's use)."""
        self._given_config = args if isinstance(args, EngineConfig) else None
        self.args = args.args if isinstance(args, EngineConfig) else args
        self.max_waiting_sequences = max_waiting_sequences
        self.metrics = metrics
        self.use_process = use_process
        self.config = None  # EngineConfig, once loaded
        self.tokenizer = None  # this side's own tokenizer: never shared with the engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        self._threads: list[threading.Thread] = []
        self._process = None
        self._stopping = False
        self.dead_error: EngineDeadError | None = None  # set once the engine core is gone
        self._dead: asyncio.Event | None = None
        self.on_crashed = None  # called (on the event loop) when the engine dies under the server
        self.kv_snapshot: dict | None = None  # the engine core's latest KV-cache picture (/dashboard)
        self.kv_snapshot_listeners: list = []  # called with each new one, on the event loop
        self._last_heard = 0.0  # time.monotonic() of the last message from the engine core
        self._heartbeat_task: asyncio.Task | None = None
        self._reaper = None  # stops the engine process at interpreter exit if shutdown() did not

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts loading the model; call from the running event loop, then `await ready()`."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._dead = asyncio.Event()
        target = self._run_process if self.use_process else self._run_thread
        self._spawn_thread(target, "kvserve-engine")
        self._heartbeat_task = self._loop.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while not self._stopping:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            if self.is_ready:
                self._commands.put(PING)

    def seconds_since_heard(self) -> float | None:
        """Seconds since the engine core last published a batch (it answers every ping with one, and
        publishes after every step); None until it is ready."""
        if not self.is_ready:
            return None
        return time.monotonic() - self._last_heard

    def _heard(self) -> None:  # on the receiving thread: the event loop may be busy
        self._last_heard = time.monotonic()

    async def ready(self) -> None:
        """Returns once the model is loaded; raises what loading raised."""
        await asyncio.shield(self._started)

    @property
    def is_ready(self) -> bool:
        return (self._started is not None and self._started.done() and not self._started.cancelled()
                and self._started.exception() is None and not self._stopping)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    async def wait_dead(self) -> EngineDeadError:
        """Returns once the engine core has died after having started (never, while it lives)."""
        await self._dead.wait()
        return self.dead_error

    @property
    def num_active(self) -> int:
        return len(self._streams)

    @property
    def num_sequences(self) -> int:
        """Sequences the engine holds for this side's live streams, running or waiting."""
        return sum(s.num_sequences for s in self._streams.values())

    def _check_queue_room(self, num_new: int) -> None:
        """The one bound on waiting work: whatever the engine cannot run at once must fit the waiting queue."""
        limit = self.max_waiting_sequences
        if limit is None:
            return
        waiting_after = self.num_sequences + num_new - self.args.max_num_seqs
        if waiting_after > limit:
            raise EngineOverloadedError(
                f"The server is busy: {self.num_sequences} sequences are running or queued and this request adds "
                f"{num_new}, more than --max-num-seqs {self.args.max_num_seqs} running plus "
                f"--max-waiting-requests {limit} waiting. Retry later.")

    def abort_all(self, reason: str) -> None:
        """Ends every request now: each stream's reader gets EngineNotReadyError(reason) (a 503)."""
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            if not stream.finished:
                stream.finished = True
                stream.fail(EngineNotReadyError(reason))
                self._commands.put(("abort", request_id))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still running and stops the engine."""
        self._stopping = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        self.abort_all("The server is shutting down.")
        self._commands.put(STOP)
        # A core still loading reads no commands yet, and has no requests to finish: stop it now.
        loading = self._started is not None and not self._started.done()
        await asyncio.get_running_loop().run_in_executor(None, self._join, 0.0 if loading else timeout)

    def _join(self, timeout: float) -> None:
        if self._process is not None:
            _stop_process(self._process, timeout)
        for t in self._threads:
            t.join(timeout)

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its outputs as the engine produces them, in `sampling_params.output_kind`
        (DELTA: each output holds only what is new). A rejected request raises ValueError before the first
        output. Leaving the loop early (or being cancelled) aborts the request and frees its KV blocks."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(stream.request_id)  # a no-op once finished

    async def add_request(self, prompt, sampling_params: SamplingParams,
                          request_id: str | None = None) -> RequestStream:
        """Adds a request and returns its stream once the engine has accepted it (ValueError if it did not),
        so a server can answer 400 before it starts a 200 response. Whoever holds the stream must read it
        to the end or call `abort(stream.request_id)`."""
        return (await self.add_requests([(request_id, prompt, sampling_params)]))[0]

    async def add_requests(self, items) -> list[RequestStream]:
        """Adds several (request_id or None, prompt, params) as one batch: the engine receives them together
        and the call waits once. All or nothing: if the engine refuses one (its error is raised), or the
        caller is cancelled (a client that left), every one of them is aborted."""
        if self.dead_error is not None:
            raise self.dead_error
        if not self.is_ready:
            raise EngineNotReadyError("The engine is not ready (the model is loading, or the server is stopping).")
        ids = [rid or uuid.uuid4().hex for rid, _, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids within one batch must differ")
        for rid in ids:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
        self._check_queue_room(sum(params.n for _, _, params in items))
        streams, commands = [], []
        group = ids[0]  # the batch is one API request: its sequences take one turn in admission
        for rid, (_, prompt, params) in zip(ids, items):
            if not isinstance(prompt, ValidatedPrompt):  # the server's prompts come parsed and validated
                # Tokenized here, not on the engine thread, so a long prompt never delays a step.
                text, token_ids = parse_prompt(prompt, self.tokenizer)
                prompt = {"prompt": text, "prompt_token_ids": token_ids}
            else:
                text, token_ids = prompt.text, prompt.token_ids
            stream = RequestStream(rid, params.output_kind, time.time(), text, token_ids, params.n)
            streams.append(stream)
            commands.append(("add", rid, prompt, params, group))
        for stream in streams:
            self._streams[stream.request_id] = stream
        for command in commands:
            self._commands.put(command)
        try:
            for stream in streams:
                await stream.accepted
        except BaseException:
            for stream in streams:
                self.abort(stream.request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its blocks (idempotent; unknown ids are ignored)."""
        stream = self._streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        stream.fail(RequestAbortedError(f"request {request_id} was aborted"))
        self._commands.put(("abort", request_id))
        if self.metrics is not None:
            self.metrics.observe_finished(FinishedRequest("abort", time.time() - stream.arrival, None, None))

    # ---- transports: this process's thread, or a child process --------------------------------------
    def _spawn_thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _run_thread(self) -> None:
        try:
            from kvserve.engine.llm_engine import LLMEngine

            engine = LLMEngine(self._resolved_config())
            tokenizer = self._load_tokenizer(engine.config)
        except BaseException as e:  # reported to the server, which exits
            logger.exception("Engine failed to start")
            self._post(self._on_started, None, None, e)
            return
        self._heard()
        self._post(self._on_started, engine.config, tokenizer, None)

        def publish(batch):
            self._heard()
            self._post(self._on_batch, batch)

        try:
            EngineCore(engine).run(self._take_commands, publish)
        except BaseException as e:  # last resort: never die silently
            logger.exception("Engine loop crashed")
            self._post(self._on_crashed, f"The engine loop crashed: {type(e).__name__}: {e}")

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run_process(self) -> None:
        """Starts the engine process, then receives its batches (this thread) while another sends commands."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        conn, child_conn = ctx.Pipe()
        try:
            config = self._resolved_config()
            self._process = ctx.Process(target=run_engine_core_process, args=(config, child_conn),
                                        name="kvserve-engine-core", daemon=True)
            self._process.start()
            # It ignores SIGTERM (group signals must not kill it under the drain), so multiprocessing's own
            # exit handler, which terminates and then joins, would wait on it for ever: this runs first.
            self._reaper = multiprocessing.util.Finalize(self, _stop_process, args=(self._process, 1.0),
                                                         exitpriority=10)
            logger.info("Engine core process started (pid %d)", self._process.pid)
            child_conn.close()
            # This side's tokenizer loads while the engine process loads the model.
            tokenizer_future = in_background(self._load_tokenizer, config)
            kind, payload = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"The engine process failed to start: {payload}")
            tokenizer = tokenizer_future.result()
        except BaseException as e:  # reported to the server, which exits
            logger.error("Engine failed to start: %s", e)
            self._post(self._on_started, None, None, e)
            return
        self._heard()
        self._post(self._on_started, config, tokenizer, None)
        self._spawn_thread(lambda: self._send_commands(conn), "kvserve-engine-send")
        # Wait on the pipe and on the process itself: a grandchild holding the pipe open must not hide the
        # engine's death, which is noticed at once either way (vLLM's EngineDeadError).
        sentinel = self._process.sentinel
        while True:
            ready = mp_connection.wait([conn, sentinel])
            try:
                if conn in ready or conn.poll(0):
                    batch = conn.recv()
                    self._heard()
                    self._post(self._on_batch, batch)
                    continue
            except (EOFError, OSError):
                break
            except Exception:  # an undecodable message must not stop the receiver
                logger.exception("Dropped a message from the engine process")
                continue
            break  # the process is gone and its last messages are read
        self._process.join(5)
        if not self._stopping:
            code = self._process.exitcode
            logger.error("The engine process died unexpectedly (exit code %s)", code)
            self._post(self._on_crashed, f"The engine process died unexpectedly (exit code {code}).")

    def _send_commands(self, conn) -> None:
        """Batches what is queued into one message: one pickle and one write per wake-up, not per command."""
        while True:
            commands = self._take_commands(block=True)
            try:
                conn.send(commands)
            except (BrokenPipeError, OSError):
                return
            if STOP in commands:
                return

    def _resolved_config(self) -> EngineConfig:
        return self._given_config if self._given_config is not None else self.args.create_engine_config()

    def _load_tokenizer(self, config):
        if self.args.skip_tokenizer_init:
            return None
        from kvserve.model.default_model import load_tokenizer

        return load_tokenizer(config.tokenizer_path)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    # ---- back on the event loop ------------------------------------------------------------------
    def _on_started(self, config, tokenizer, error) -> None:
        if error is not None:
            self._started.set_exception(error)
            return
        self.config, self.tokenizer = config, tokenizer
        self._started.set_result(None)

    def _on_crashed(self, reason: str) -> None:
        self.dead_error = EngineDeadError(f"{reason} The server cannot serve requests any more and is exiting.")
        for stream in list(self._streams.values()):
            stream.finished = True
            stream.fail(self.dead_error)
        self._streams.clear()
        self._dead.set()
        if self.on_crashed is not None:
            self.on_crashed()

    def _on_batch(self, batch: EngineBatch) -> None:
        accepted, outputs, failed, stats = batch.accepted, batch.outputs, batch.failed, batch.stats
        for rid, error in accepted:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if error is None:
                stream.accepted.set_result(None)
            else:
                del self._streams[rid]
                stream.finished = True
                stream.fail(error)
        for rid in failed:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.finished = True
                stream.fail(EngineFailedError(getattr(batch, "failed_reason", None)
                                              or "The engine failed while running this request; see the server log."))
        num_prompt = num_generated = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted after the step was scheduled
                continue
            try:
                if out.prompt_token_ids is None:
                    out.prompt, out.prompt_token_ids = stream.prompt, stream.prompt_token_ids
                new_prompt, new_generated = self._account(stream, out)
            except Exception as e:  # one bad output must not leave every other stream waiting
                logger.exception("Could not deliver an output of request %s", out.request_id)
                self.abort(out.request_id)
                stream.fail(EngineFailedError(f"Could not deliver this request's output: {e}"))
                continue
            num_prompt += new_prompt
            num_generated += new_generated
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
                self._observe_finished(stream, out)
            stream.put(out)
        if self.metrics is not None:
            self.metrics.observe_iteration(num_prompt, num_generated)
            self.metrics.observe_engine(stats)
        if batch.kv_snapshot is not None:
            self.kv_snapshot = batch.kv_snapshot
            for listener in self.kv_snapshot_listeners:
                listener(batch.kv_snapshot)

    def _account(self, stream: RequestStream, out: RequestOutput) -> tuple[int, int]:
        """Prompt and generated tokens this output adds to the counters (and the throughput log): the
        growth of the engine's own count for the request. A prompt counts once its first token is out."""
        counted_prompt, counted_generated = stream.counted
        generated = out.metrics.num_generation_tokens
        prompt = out.metrics.num_prompt_tokens if generated else 0
        stream.counted = (prompt, generated)
        if not counted_generated and generated:
            if self.metrics is not None:
                m = out.metrics
                first = m.first_token_time if m is not None and m.first_token_time else time.time()
                # From when the server took the request, not when the engine did: what a client waits.
                self.metrics.observe_first_token(max(first - stream.arrival, 0.0))
        return prompt - counted_prompt, generated - counted_generated

    def _observe_finished(self, stream: RequestStream, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        m = out.metrics
        arrival = stream.arrival  # the server's clock: the engine process shares time.time()
        finished = (m.finished_time if m is not None and m.finished_time else None) or time.time()
        queue_time = None
        if m is not None and m.first_scheduled_time is not None:
            queue_time = max(m.first_scheduled_time - arrival, 0.0)
        tpot = None
        most = max(m.sample_generation_tokens, default=0) if m is not None else 0
        if m is not None and m.first_token_time is not None and most > 1:
            tpot = (finished - m.first_token_time) / (most - 1)
        reason = (m.finish_reason if m is not None else None) or "stop"
        self.metrics.observe_finished(FinishedRequest(reason, finished - arrival, queue_time, tpot))
