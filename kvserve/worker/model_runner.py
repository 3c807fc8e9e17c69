"""Turns a SchedulerOutput into one flat forward pass and returns each request's sampled token."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.core.scheduler import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from kvserve.distributed.parallel_state import recv_from_prev_stage, send_to_next_stage
from kvserve.model.loader import DTYPES, load_model
from kvserve.ops.attention_backend import get_attention_backend
from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from kvserve.structured_output.bitmask import apply_token_bitmask
from kvserve.worker.memory_plan import mixed_graph_sizes
from kvserve.worker.runner_output import PendingOutput, compute_prompt_logprobs
from kvserve.worker.sampler import SamplingMetadata, sample
from kvserve.worker.sampling_metadata import build_sampling_metadata
from kvserve.worker.step_inputs import NO_PLACEHOLDERS, StagingBuffer, StepInputs, fill_placeholders

logger = logging.getLogger(__name__)


class BlockTables:
    """Every running request's block ids in one persistent numpy array (a row per request), so a step
    gathers its table with one fancy index instead of rebuilding it from Python lists."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int64)
        self.lengths = np.zeros(max_rows, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def add(self, rid: str, block_ids: list[int]) -> None:
        if not self.free_rows:  # more live requests than max_num_seqs (possible only transiently)
            grow = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self.free_rows = list(range(2 * grow - 1, grow - 1, -1))
        row = self.free_rows.pop()
        self.rows[rid] = row
        self.lengths[row] = 0
        self.append(rid, block_ids)

    def append(self, rid: str, block_ids: list[int]) -> None:
        row = self.rows[rid]
        n = int(self.lengths[row])
        self.table[row, n:n + len(block_ids)] = block_ids
        self.lengths[row] = n + len(block_ids)

    def release(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.free_rows.append(row)

    def gather(self, rids: list[str]) -> np.ndarray:
        rows = np.fromiter((self.rows[r] for r in rids), dtype=np.int64, count=len(rids))
        return self.table[rows, : int(self.lengths[rows].max())]


class ModelRunner:
    def __init__(self, config: EngineConfig, layer_range: tuple[int, int] | None = None):
        """layer_range: the decoder layers of this pipeline stage (default: all)."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        # The KV cache's storage dtype: the model's, or e4m3 (--kv-cache-dtype fp8), half the bytes of bf16.
        self.kv_cache_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        self.calculate_kv_scales_pending = config.args.calculate_kv_scales and config.kv_cache_dtype != "auto"
        self.block_size = config.args.block_size
        self.model_config = config.model_config
        self.max_model_len = config.max_model_len
        self.backend = get_attention_backend(config.attention_backend)
        self.model = load_model(
            config.model_config,
            config.model_path,
            config.args.load_format,
            config.dtype,
            config.device,
            self.backend,
            max_positions=config.max_model_len,
            seed=config.args.seed,
            layer_range=layer_range,
            quant_config=config.quant_config,
        )
        if self.device.type == "cpu":
            from kvserve.ops.cpu_gemm import pack_cpu_linears
            from kvserve.worker.cpu_malloc import tune_malloc_for_cpu_inference

            pack_cpu_linears(self.model)
            tune_malloc_for_cpu_inference()  # before the KV cache and the first step allocate
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.cpu_kv_caches: list[torch.Tensor] = []  # the swap space (--swap-space), same layout on the host
        self.staging = StagingBuffer(1 << 20) if self.device.type == "cuda" else None
        self.graph_runner: CudaGraphRunner | None = None
        self.graph_sizes = capture_sizes(config.args.max_num_seqs)
        # Per-request state that outlives a step.
        max_blocks = -(-config.max_model_len // self.block_size)
        self.block_tables = BlockTables(config.args.max_num_seqs, max_blocks)
        self.generators: dict[str, torch.Generator] = {}
        # The last step's sampled ids stay on the device: with async scheduling the next step's inputs
        # hold placeholders for them, filled here by request row without a trip through the host.
        self.last_sampled: torch.Tensor | None = None
        self.last_sampled_rows: dict[str, int] = {}

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """This rank's bytes per block: its layers (pipeline stage) and its KV heads (tensor parallel)."""
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        model = self.model
        return model.num_local_layers * 2 * model.num_local_kv_heads * self.model_config.head_dim * elem * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.model.num_local_kv_heads, self.model_config.head_dim)
        # Zeros, not empty: padded reads of never-written slots must be finite (0 * NaN = NaN).
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(self.model.num_local_layers)]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    # ---- swap space (preemption by swapping) --------------------------------------------------------------
    def initialize_swap_space(self, num_cpu_blocks: int) -> None:
        """Host blocks shaped like the device's; pinned on CUDA so copies run at full bus speed."""
        pin = self.device.type == "cuda"
        self.cpu_kv_caches = [
            torch.zeros((gpu.shape[0], num_cpu_blocks, *gpu.shape[2:]), dtype=gpu.dtype, device="cpu", pin_memory=pin)
            for gpu in self.kv_caches
        ]

    def swap_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copies (gpu_block, cpu_block) pairs out to the swap space or back in, in every layer."""
        if not pairs:
            return
        gpu_idx = torch.tensor([g for g, _ in pairs], dtype=torch.long, device=self.device)
        cpu_idx = torch.tensor([c for _, c in pairs], dtype=torch.long)
        for gpu, cpu in zip(self.kv_caches, self.cpu_kv_caches):
            if to_cpu:
                cpu[:, cpu_idx] = gpu[:, gpu_idx].to("cpu")
            else:
                gpu[:, gpu_idx] = cpu[:, cpu_idx].to(self.device, non_blocking=True)

    @torch.inference_mode()
    def measure_preemption_costs(self, num_tokens: int) -> tuple[float, float]:
        """(seconds to recompute one token, seconds to copy one block out and back in), timed on this
        device at start-up, for --preemption-mode auto. The cache holds nothing yet, so copying is harmless."""
        import time

        def timed(fn) -> float:
            fn()  # warm-up
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            return time.perf_counter() - t0

        num_tokens = max(1, num_tokens)
        recompute = timed(lambda: self.profile_run(num_tokens, 1)) / num_tokens
        n = max(1, min(64, self.num_blocks, self.cpu_kv_caches[0].shape[1] if self.cpu_kv_caches else 0))
        pairs = [(i, i) for i in range(n)]
        swap = timed(lambda: (self.swap_blocks(pairs, to_cpu=True), self.swap_blocks(pairs, to_cpu=False))) / n
        return recompute, swap

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def decode_num_kv_splits(self, num_reqs: int) -> int | None:
        """Split-KV count for a decode step, from the padded batch size and max_model_len only, so graph
        replays and eager steps of the same requests reduce in the same order (identical tokens)."""
        choose = getattr(self.backend, "choose_num_splits", None)
        if choose is None:
            return None
        padded = next((s for s in self.graph_sizes if s >= num_reqs), num_reqs)
        return choose(padded, self.model.num_local_kv_heads, 1, self.max_model_len)

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        if self.device.type != "cuda" or self.config.args.enforce_eager:
            return
        if self.config.args.pipeline_parallel_size > 1:
            logger.info("CUDA graphs are not captured with pipeline parallelism; running eagerly")
            return
        if self.config.attention_backend != "triton":
            logger.info("CUDA graphs need the triton attention backend; running eagerly")
            return
        self.graph_runner = CudaGraphRunner(
            self.model, self.kv_caches, self.block_size, -(-self.max_model_len // self.block_size),
            self.max_model_len, self.graph_sizes, self.device, self.decode_num_kv_splits,
            mixed_sizes=mixed_graph_sizes(self.config.max_num_batched_tokens),
            max_num_seqs=self.config.args.max_num_seqs,
        )
        self.graph_runner.capture()

    # ---- profiling (memory sizing) -----------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A forward at the largest step (num_tokens over num_seqs requests) plus sampling at
        num_seqs rows, on a scratch KV cache just big enough, so the peak activation can be measured."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        q_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        q_lens[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-int(q_lens.max()) // self.block_size)
        scratch = self.allocate_kv_cache(num_seqs * blocks_per_seq)
        tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int64).reshape(num_seqs, blocks_per_seq)
        inputs, meta = self._build_inputs(
            token_ids=np.zeros(num_tokens, dtype=np.int64), q_lens=q_lens,
            starts=np.zeros(num_seqs, dtype=np.int64), tables=tables, logits_rows=list(range(num_seqs)),
            placeholders=NO_PLACEHOLDERS,
        )
        intermediate = None
        if not self.model.is_first_stage:
            zeros = torch.zeros(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        hidden = self.model(inputs.input_ids, inputs.positions, scratch, meta, intermediate)
        if not self.model.is_last_stage:
            del scratch, hidden
            return
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        # Sampling with every filter on is the sampler's worst case for memory (sorts over the vocab).
        meta_s = SamplingMetadata(
            temperature=torch.ones(num_seqs, device=self.device),
            top_k=torch.full((num_seqs,), 50, device=self.device),
            top_p=torch.full((num_seqs,), 0.9, device=self.device),
            min_p=torch.full((num_seqs,), 0.05, device=self.device),
            generators={}, all_greedy=False,
        )
        sample(logits, meta_s)
        del scratch, hidden, logits
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- one step --------------------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        tables = self.block_tables
        for rid in out.finished_req_ids:
            tables.release(rid)
            self.generators.pop(rid, None)
        for rid in out.preempted_req_ids:
            tables.release(rid)  # the generator stays: a resumed request continues its stream
        for s in out.scheduled:
            if s.is_new:
                tables.release(s.request_id)
                tables.add(s.request_id, s.new_block_ids)
            elif s.new_block_ids:
                tables.append(s.request_id, s.new_block_ids)
            seed = getattr(s.sampling_params, "seed", None)
            if seed is not None and s.request_id not in self.generators:
                self.generators[s.request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def _positions_and_slots(self, q_lens, starts, tables):
        num_reqs = len(q_lens)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        req_idx = np.repeat(np.arange(num_reqs), q_lens)
        positions = np.arange(num_tokens) - qsl[req_idx] + starts[req_idx]
        bs = self.block_size
        slot_mapping = tables[req_idx, positions // bs] * bs + positions % bs
        return qsl, positions, slot_mapping

    def _build_inputs(self, token_ids, q_lens, starts, tables, logits_rows, placeholders
                      ) -> tuple[StepInputs, AttentionMetadata]:
        qsl, positions, slot_mapping = self._positions_and_slots(q_lens, starts, tables)
        num_tokens = int(qsl[-1])
        seq_lens = starts + q_lens
        bs = self.block_size
        placeholder_index, placeholder_rows = placeholders
        inputs = StepInputs(
            dict(
                input_ids=token_ids, positions=positions, slot_mapping=slot_mapping, query_start_loc=qsl,
                seq_lens=seq_lens, logits_indices=qsl[1:][logits_rows] - 1, placeholder_index=placeholder_index,
                placeholder_rows=placeholder_rows, block_tables=tables,
            ),
            self.device,
            self.staging,
        )
        if placeholder_index.size:
            fill_placeholders(inputs.input_ids, inputs.placeholder_index, inputs.placeholder_rows, self.last_sampled)
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_actual_tokens=num_tokens,
            block_size=bs,
            query_start_loc_cpu=inputs.query_start_loc_cpu,
            seq_lens_cpu=inputs.seq_lens_cpu,
        )
        return inputs, meta

    def _host_arrays(self, out: SchedulerOutput):
        sched = out.scheduled
        num_reqs = len(sched)
        q_lens = np.fromiter((len(s.token_ids) for s in sched), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.start_pos for s in sched), dtype=np.int64, count=num_reqs)
        token_ids = np.fromiter((t for s in sched for t in s.token_ids), dtype=np.int64, count=int(q_lens.sum()))
        tables = self.block_tables.gather([s.request_id for s in sched])
        logits_rows = [i for i, s in enumerate(sched) if s.needs_sample]
        return token_ids, q_lens, starts, tables, logits_rows, self._placeholders(sched, token_ids, q_lens)

    def _placeholders(self, sched, token_ids: np.ndarray, q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat index in the step's tokens, row in last_sampled) of each token sampled by the step in flight.
        Only the last token of a request's chunk can be one."""
        index = np.flatnonzero(token_ids == PLACEHOLDER_TOKEN_ID)
        if not index.size:
            return NO_PLACEHOLDERS
        reqs = np.searchsorted(np.cumsum(q_lens), index, side="right")
        rows = np.fromiter((self.last_sampled_rows[sched[i].request_id] for i in reqs), dtype=np.int64,
                           count=len(reqs))
        return index, rows

    def prepare_inputs(self, out: SchedulerOutput):
        token_ids, q_lens, starts, tables, logits_rows, placeholders = self._host_arrays(out)
        inputs, meta = self._build_inputs(token_ids, q_lens, starts, tables, logits_rows, placeholders)
        return inputs, meta, logits_rows

    def _run_graph(self, out: SchedulerOutput):
        """Steps that fit a captured graph: (hidden states of the rows that sample, those rows), or None
        when the step must run eagerly."""
        graphs = self.graph_runner
        if graphs is None:
            return None
        if any(getattr(s.sampling_params, "prompt_logprobs", None) is not None for s in out.scheduled):
            return None
        num_reqs = len(out.scheduled)
        decode_only = all(len(s.token_ids) == 1 for s in out.scheduled)
        if decode_only and graphs.padded_size(num_reqs) is not None:
            token_ids, q_lens, starts, tables, _, placeholders = self._host_arrays(out)
            _, positions, slot_mapping = self._positions_and_slots(q_lens, starts, tables)
            hidden = graphs.run(num_reqs, token_ids, positions, slot_mapping, starts + 1, tables,
                                placeholders, self.last_sampled)
            return hidden, list(range(num_reqs))  # decode: one token per request, every one samples
        num_tokens = sum(len(s.token_ids) for s in out.scheduled)
        if graphs.mixed_padded_size(num_tokens) is None:
            return None
        token_ids, q_lens, starts, tables, rows, placeholders = self._host_arrays(out)
        qsl, positions, slot_mapping = self._positions_and_slots(q_lens, starts, tables)
        logits_indices = qsl[1:][rows] - 1
        hidden = graphs.run_mixed(token_ids, positions, slot_mapping, qsl, starts + q_lens, tables,
                                  logits_indices, placeholders, self.last_sampled)
        return hidden, rows

    def _sampling_metadata(self, out: SchedulerOutput, rows: list[int], vocab_size: int) -> SamplingMetadata:
        return build_sampling_metadata([out.scheduled[i] for i in rows], self.generators, vocab_size, self.device)

    @staticmethod
    def _apply_grammar_bitmask(logits: torch.Tensor, out: SchedulerOutput, rids: list[str]) -> None:
        """Structured outputs: each constrained request's row of the step's bitmask onto its logits row."""
        mask_row = out.structured_output_request_ids
        logits_rows = [j for j, rid in enumerate(rids) if rid in mask_row]
        if logits_rows:
            masks = out.grammar_bitmask[[mask_row[rids[j]] for j in logits_rows]]
            apply_token_bitmask(logits, masks, logits_rows)

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> PendingOutput:
        """Launches the step; its sampled ids reach the host when the PendingOutput is resolved, so the
        caller can schedule and launch the next step meanwhile."""
        self._update_states(out)
        # Swap-outs first: a block swapped out in this step may be swapped into or written by this step.
        self.swap_blocks(getattr(out, "blocks_to_swap_out", None), to_cpu=True)
        self.swap_blocks(getattr(out, "blocks_to_swap_in", None), to_cpu=False)
        if out.is_empty:
            return PendingOutput.empty()
        calculate_kv_scales = self.calculate_kv_scales_pending
        if calculate_kv_scales:
            # The first real batch computes the scales, eagerly (a graph replay would skip the Python
            # branch); graphs read the scale buffers by address, so later replays see the values.
            self.calculate_kv_scales_pending = False
            for module in self.model.modules():
                if hasattr(module, "calculate_kv_scales"):
                    module.calculate_kv_scales = True
        num_reqs = len(out.scheduled)
        graph_out = None if calculate_kv_scales else self._run_graph(out)
        if graph_out is not None:
            logits_input, rows = graph_out
        else:
            inputs, meta, rows = self.prepare_inputs(out)
            if meta.max_query_len == 1:
                meta.num_kv_splits = self.decode_num_kv_splits(num_reqs)
            model = self.model
            intermediate = None
            if not model.is_first_stage:  # the previous stage's hidden states and residual
                shape = (meta.num_actual_tokens, self.model_config.hidden_size)
                intermediate = recv_from_prev_stage([shape, shape], self.dtype, self.device)
            hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, meta, intermediate)
            if not model.is_last_stage:  # only the last stage computes logits and samples
                send_to_next_stage(list(hidden))
                return PendingOutput.empty()
            logits_input = hidden[inputs.logits_indices] if rows else None
        prompt_logprobs = {}
        if any(getattr(s.sampling_params, "prompt_logprobs", None) is not None for s in out.scheduled):
            prompt_logprobs = compute_prompt_logprobs(
                out.scheduled, inputs.query_start_loc_cpu.tolist(), hidden, self.model.compute_logits,
                self.model_config.vocab_size)
        if not rows:
            return PendingOutput.empty(prompt_logprobs)
        logits = self.model.compute_logits(logits_input).float()
        scheduled = [out.scheduled[i] for i in rows]
        rids = [s.request_id for s in scheduled]
        if out.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, out, rids)
        sampler_out = sample(logits, self._sampling_metadata(out, rows, logits.shape[-1]))
        self.last_sampled = sampler_out.sampled
        self.last_sampled_rows = {rid: j for j, rid in enumerate(rids)}
        wants_logprobs = [s.sampling_params.logprobs is not None for s in scheduled]
        return PendingOutput(rids, sampler_out, wants_logprobs, prompt_logprobs)
