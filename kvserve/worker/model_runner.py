"""Turns a step message into one flat forward pass and returns each request's sampled tokens (one, or
with drafts to verify, the accepted drafts plus one)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.core.kv_cache_groups import layer_placements
from kvserve.core.sched_output import StepMessage
from kvserve.distributed.parallel_state import recv_from_prev_stage, send_to_next_stage
from kvserve.model.loader import DTYPES, load_model
from kvserve.ops.attention_backend import get_attention_backend
from kvserve.ops.attention_metadata import AttentionMetadata
from kvserve.worker import memory
from kvserve.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from kvserve.structured_output.bitmask import apply_token_bitmask
from kvserve.worker.input_batch import NO_PLACEHOLDERS, InputBatch, StepLayout
from kvserve.sizing.memory_plan import mixed_graph_sizes
from kvserve.worker.runner_output import DeferredOutput, PendingOutput, compute_prompt_logprobs
from kvserve.worker.sampler import SamplingMetadata, sample
from kvserve.worker.sampling_metadata import build_sampling_metadata
from kvserve.worker.spec_verify import verify_drafts
from kvserve.worker.step_inputs import StagingBuffer, StepInputs, fill_placeholders

logger = logging.getLogger(__name__)


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
        # KV cache groups (core/kv_cache_groups.py): which of this stage's KV tensors each layer uses. A
        # model whose layers all attend alike has one group and a tensor per layer.
        self.num_kv_cache_groups = len(self.model_config.kv_cache_groups)
        placements = layer_placements(self.model_config.layer_windows or [None] * self.model_config.num_hidden_layers,
                                      range(self.model.start_layer, self.model.end_layer))
        self.layer_kv_slots = [placements[i].slot for i in range(self.model.start_layer, self.model.end_layer)]
        self.num_kv_slots = max(self.layer_kv_slots) + 1
        self.kv_tensors: list[torch.Tensor] = []  # [num_kv_slots] x [2, num_blocks, block_size, Hkv, D]
        self.kv_caches: list[torch.Tensor] = []  # per local layer: its slot's tensor (what the model reads)
        # A draft model or an EAGLE-3 head: fills the draft slots each step, its cache in the same blocks.
        self.draft_runner = None
        spec = config.args.speculative_config
        if spec is not None and spec.method == "draft_model":
            from kvserve.worker.draft_model_runner import DraftModelRunner

            self.draft_runner = DraftModelRunner(config, self.backend, self.kv_cache_dtype, self._build_inputs)
        elif spec is not None and spec.method == "eagle3":
            from kvserve.worker.eagle3_runner import Eagle3Runner

            self.draft_runner = Eagle3Runner(config, self.model, self.backend, self.kv_cache_dtype,
                                             self._build_inputs)
        self.eagle = spec is not None and spec.method == "eagle3"
        self.num_blocks = 0
        self.cpu_kv_caches: list[torch.Tensor] = []  # the swap space (--swap-space), kv_tensors' layout on the host
        self.staging = StagingBuffer(1 << 20) if self.device.type == "cuda" else None
        self.graph_runner: CudaGraphRunner | None = None
        self.graph_sizes = capture_sizes(config.args.max_num_seqs)
        # Per-request state that outlives a step: one owner, whichever executor delivers the steps.
        self.input_batch = InputBatch(config.args.max_num_seqs, -(-config.max_model_len // self.block_size),
                                      self.block_size, self.device, self.num_kv_cache_groups)
        # The step launched with grammar_bitmask_deferred, until its mask arrives: (handle, sample(mask, rows)).
        self._deferred = None

    # ---- KV cache --------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """This rank's bytes per block: one per KV tensor of its stage (a tensor per layer, or per layer of
        a KV cache group), of its KV heads (tensor parallel), and a draft model's K/V of the same tokens."""
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        per_head = self.model_config.kv_cache_head_dim
        target = self.num_kv_slots * 2 * self.model.num_local_kv_heads * per_head * elem * self.block_size
        return target + (memory.draft_kv_bytes_per_block(self.config) if self.draft_runner is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        """The stage's KV tensors, one per slot."""
        shape = (2, num_blocks, self.block_size, self.model.num_local_kv_heads, self.model_config.kv_cache_head_dim)
        # Zeros, not empty: padded reads of never-written slots must be finite (0 * NaN = NaN).
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(self.num_kv_slots)]

    def layer_caches(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each local layer's KV tensor."""
        return [tensors[slot] for slot in self.layer_kv_slots]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_tensors = self.allocate_kv_cache(num_blocks)
        self.kv_caches = self.layer_caches(self.kv_tensors)
        self.num_blocks = num_blocks
        if self.draft_runner is not None:
            self.draft_runner.initialize_kv_cache(num_blocks)

    # ---- swap space (preemption by swapping) --------------------------------------------------------------
    def initialize_swap_space(self, num_cpu_blocks: int) -> None:
        """Host blocks shaped like the device's; pinned on CUDA so copies run at full bus speed."""
        pin = self.device.type == "cuda"
        self.cpu_kv_caches = [
            torch.zeros((gpu.shape[0], num_cpu_blocks, *gpu.shape[2:]), dtype=gpu.dtype, device="cpu", pin_memory=pin)
            for gpu in self.kv_tensors
        ]

    def swap_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copies (gpu_block, cpu_block) pairs out to the swap space or back in, in every KV tensor."""
        if not pairs:
            return
        gpu_idx = torch.tensor([g for g, _ in pairs], dtype=torch.long, device=self.device)
        cpu_idx = torch.tensor([c for _, c in pairs], dtype=torch.long)
        for gpu, cpu in zip(self.kv_tensors, self.cpu_kv_caches):
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
        return choose(padded, self.model.num_local_kv_heads, 1, self.max_model_len,
                      getattr(self.model, "attention_head_dim", 128))

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        if self.device.type != "cuda" or self.config.args.enforce_eager:
            return
        if self.config.args.pipeline_parallel_size > 1:
            logger.info("CUDA graphs are not captured with pipeline parallelism; running eagerly")
            return
        if self.config.attention_backend != "triton":
            logger.info("CUDA graphs need the triton attention backend; running eagerly")
            return
        if self.eagle:
            logger.info("CUDA graphs are not captured with an EAGLE-3 head (the head reads the target's hidden "
                        "states of every step); running eagerly")
            return
        self.graph_runner = CudaGraphRunner(
            self.model, self.kv_caches, self.block_size, -(-self.max_model_len // self.block_size),
            self.max_model_len, self.graph_sizes, self.device, self.decode_num_kv_splits,
            mixed_sizes=mixed_graph_sizes(self.config.max_num_batched_tokens),
            max_num_seqs=self.config.args.max_num_seqs, num_kv_cache_groups=self.num_kv_cache_groups,
        )
        self.graph_runner.capture()

    # ---- profiling (memory sizing) -----------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int) -> int:
        """A forward at the largest step (num_tokens over num_seqs requests) plus sampling at
        num_seqs rows, on a scratch KV cache just big enough, so the peak activation can be measured.
        Returns the scratch cache's bytes: a real step writes into the KV cache the budget counts already,
        so the scratch is part of the measured peak but not of the activations."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        q_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        q_lens[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-int(q_lens.max()) // self.block_size)
        scratch_tensors = self.allocate_kv_cache(num_seqs * blocks_per_seq)
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch_tensors)
        scratch = self.layer_caches(scratch_tensors)
        tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int64).reshape(num_seqs, blocks_per_seq)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        req_idx = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens) - qsl[req_idx]
        bs = self.block_size
        slot_mapping = tables[req_idx, positions // bs] * bs + positions % bs
        layout = StepLayout(
            token_ids=np.zeros(num_tokens, dtype=np.int64), q_lens=q_lens, starts=np.zeros(num_seqs, dtype=np.int64),
            block_tables=tables, query_start_loc=qsl, positions=positions,
            slot_mapping=slot_mapping, logits_indices=qsl[1:] - 1,
            sample_states=[], sampling_requests=[], placeholders=NO_PLACEHOLDERS, has_drafts=False,
            other_groups=((tables, slot_mapping),) * (self.num_kv_cache_groups - 1),  # every group on one table
        )
        inputs, meta = self._build_inputs(layout)
        intermediate = None
        if not self.model.is_first_stage:
            zeros = torch.zeros(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        hidden = self.model(inputs.input_ids, inputs.positions, scratch, meta, intermediate)
        if self.eagle:
            hidden = hidden[0]
        if not self.model.is_last_stage:
            del scratch, scratch_tensors, hidden
            return scratch_bytes
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        # Sampling with every filter on and logprobs is the sampler's worst case for memory (sorts over the
        # vocab, and the raw logprobs stay alive beside them).
        max_logprobs = self.config.args.max_logprobs
        meta_s = SamplingMetadata(
            temperature=torch.ones(num_seqs, device=self.device),
            top_k=torch.full((num_seqs,), 50, device=self.device),
            top_p=torch.full((num_seqs,), 0.9, device=self.device),
            min_p=torch.full((num_seqs,), 0.05, device=self.device),
            generators={}, all_greedy=False,
            max_num_logprobs=max_logprobs if max_logprobs >= 0 else logits.shape[-1],  # sample() caps it at V
        )
        sample(logits, meta_s)
        del scratch, scratch_tensors, hidden, logits
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return scratch_bytes

    # ---- one step --------------------------------------------------------------------------------
    def _build_inputs(self, layout: StepLayout) -> tuple[StepInputs, AttentionMetadata]:
        seq_lens = layout.seq_lens
        placeholder_index, placeholder_rows = layout.placeholders
        arrays = dict(
            input_ids=layout.token_ids, positions=layout.positions, slot_mapping=layout.slot_mapping,
            query_start_loc=layout.query_start_loc, seq_lens=seq_lens, logits_indices=layout.logits_indices,
            placeholder_index=placeholder_index, placeholder_rows=placeholder_rows,
            block_tables=layout.block_tables,
        )
        for g, (tables, slots) in enumerate(layout.other_groups, start=1):
            arrays[f"block_tables_{g}"], arrays[f"slot_mapping_{g}"] = tables, slots
        inputs = StepInputs(arrays, self.device, self.staging)
        if placeholder_index.size:
            fill_placeholders(inputs.input_ids, inputs.placeholder_index, inputs.placeholder_rows,
                              self.input_batch.last_sampled)
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables,
            max_query_len=int(layout.q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            num_actual_tokens=int(layout.token_ids.size),
            block_size=self.block_size,
            query_start_loc_cpu=inputs.query_start_loc_cpu,
            seq_lens_cpu=inputs.seq_lens_cpu,
        )
        if layout.other_groups:  # each group attends over its own tables (a fresh plan cache each)
            meta.other_groups = tuple(
                dataclasses.replace(meta, block_tables=getattr(inputs, f"block_tables_{g}"),
                                    slot_mapping=getattr(inputs, f"slot_mapping_{g}"), backend_cache={})
                for g in range(1, len(layout.other_groups) + 1))
        return inputs, meta

    def _run_graph(self, batch, layout: StepLayout):
        """Steps that fit a captured graph: the hidden states of the positions that sample, or None when
        the step must run eagerly. The graphs read the same layout as the eager forward."""
        graphs = self.graph_runner
        if graphs is None:
            return None
        if self.input_batch.wants_prompt_logprobs(batch):
            return None
        num_reqs = len(batch)
        last_sampled = self.input_batch.last_sampled
        decode_only = int(layout.q_lens.max()) == 1 and len(layout.sample_states) == num_reqs  # each samples
        if decode_only and graphs.padded_size(num_reqs) is not None:
            return graphs.run(num_reqs, layout.token_ids, layout.positions, layout.slot_mapping, layout.starts + 1,
                              layout.block_tables, layout.placeholders, last_sampled, layout.other_groups)
        if graphs.mixed_padded_size(int(layout.token_ids.size)) is None or not graphs.fits_rows(layout.logits_indices.size):
            return None
        return graphs.run_mixed(layout.token_ids, layout.positions, layout.slot_mapping, layout.query_start_loc,
                                layout.seq_lens, layout.block_tables, layout.logits_indices, layout.placeholders,
                                last_sampled, layout.other_groups)

    @staticmethod
    def _apply_grammar_bitmask(logits: torch.Tensor, bitmask, first_row: dict[str, int], requests: list) -> None:
        """Structured outputs: each constrained request's rows of the step's bitmask onto its logits rows (one
        per position: 1 + its drafts), in one apply."""
        logits_rows, mask_rows = [], []
        row = 0
        for s in requests:
            n = 1 + len(s.spec_token_ids)
            first = first_row.get(s.request_id)
            if first is not None:
                logits_rows += range(row, row + n)
                mask_rows += range(first, first + n)
            row += n
        if logits_rows:
            apply_token_bitmask(logits, bitmask, logits_rows, mask_rows)

    @torch.inference_mode()
    def sample_deferred(self, bitmask, mask_row: dict[str, int]) -> None:
        """The grammar bitmask of the step launched last with `grammar_bitmask_deferred`: applied, then the
        step samples (its forward has been queued or done meanwhile)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            raise RuntimeError("a grammar bitmask arrived for no step waiting for one")
        handle, sample = deferred
        handle.resolve(sample(bitmask, mask_row))

    def _drop_deferred(self) -> None:
        """A step that waited for its mask when the next one arrived (its engine step failed): it ends empty,
        so whoever waits on it goes on."""
        if self._deferred is not None:
            self._deferred[0].resolve(PendingOutput.empty())
            self._deferred = None

    @torch.inference_mode()
    def execute_async(self, msg: StepMessage) -> PendingOutput:
        """Launches the step; its sampled ids reach the host when the PendingOutput is resolved, so the
        caller can schedule and launch the next step meanwhile."""
        self._drop_deferred()
        batch = self.input_batch.apply(msg)
        if self.draft_runner is not None:
            self.draft_runner.apply(msg)
        # Swap-outs first: a block swapped out in this step may be swapped into or written by this step.
        self.swap_blocks(msg.blocks_to_swap_out, to_cpu=True)
        self.swap_blocks(msg.blocks_to_swap_in, to_cpu=False)
        if not batch:
            return PendingOutput.empty()
        calculate_kv_scales = self.calculate_kv_scales_pending
        if calculate_kv_scales:
            # The first real batch computes the scales, eagerly (a graph replay would skip the Python
            # branch); graphs read the scale buffers by address, so later replays see the values.
            self.calculate_kv_scales_pending = False
            for module in self.model.modules():
                if hasattr(module, "calculate_kv_scales"):
                    module.calculate_kv_scales = True
        if self.draft_runner is not None and any(s.spec_token_ids for s in batch):
            self.draft_runner.propose(batch, self.input_batch.block_tables.gather([s.request_id for s in batch]))
        layout = self.input_batch.layout(batch)
        logits_input = None if calculate_kv_scales else self._run_graph(batch, layout)
        aux = None
        if logits_input is None:
            inputs, meta = self._build_inputs(layout)
            if meta.max_query_len == 1:
                meta.num_kv_splits = self.decode_num_kv_splits(len(batch))
                for group_meta in meta.other_groups:
                    group_meta.num_kv_splits = meta.num_kv_splits
            model = self.model
            intermediate = None
            if not model.is_first_stage:  # the previous stage's hidden states and residual
                shape = (meta.num_actual_tokens, self.model_config.hidden_size)
                intermediate = recv_from_prev_stage([shape, shape], self.dtype, self.device)
            hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, meta, intermediate)
            if self.eagle:  # the target also returns the states its head reads
                hidden, aux = hidden
            if not model.is_last_stage:  # only the last stage computes logits and samples
                send_to_next_stage(list(hidden))
                return PendingOutput.empty()
            logits_input = hidden[inputs.logits_indices] if layout.sample_states else None
        prompt_logprobs = {}
        if self.input_batch.wants_prompt_logprobs(batch):
            prompt_logprobs = compute_prompt_logprobs(
                batch, inputs.query_start_loc_cpu.tolist(), hidden, self.model.compute_logits,
                self.model_config.vocab_size)
        if not layout.sample_states:
            if aux is not None:
                self.draft_runner.observe(batch, layout, inputs, meta, aux, None)
            return PendingOutput.empty(prompt_logprobs)
        logits = self.model.compute_logits(logits_input).float()

        def observe_drafts(sampled) -> None:  # the draft proposer reads the target's states and sampled ids
            if aux is not None:
                self.draft_runner.observe(batch, layout, inputs, meta, aux, sampled)

        def sample_step(bitmask, mask_row: dict[str, int]) -> PendingOutput:
            return self._sample(logits, layout, bitmask, mask_row, prompt_logprobs, observe_drafts)

        if msg.grammar_bitmask_deferred:
            handle = DeferredOutput()
            self._deferred = (handle, sample_step)
            return handle
        return sample_step(msg.grammar_bitmask, msg.structured_output_request_ids)

    def _sample(self, logits: torch.Tensor, layout: StepLayout, bitmask, mask_row: dict[str, int],
                prompt_logprobs: dict, observe_drafts) -> PendingOutput:
        requests = layout.sampling_requests
        rids = [s.request_id for s in requests]
        wants_logprobs = [s.sampling_params.logprobs is not None for s in requests]
        if bitmask is not None:
            self._apply_grammar_bitmask(logits, bitmask, mask_row, requests)
        if not layout.has_drafts:
            meta_s = build_sampling_metadata(layout.sample_states, self.input_batch.generators, logits.shape[-1],
                                             self.device)
            sampler_out = sample(logits, meta_s)
            self.input_batch.record_sampled(sampler_out.sampled, layout)
            observe_drafts(sampler_out.sampled)
            return PendingOutput(rids, sampler_out, wants_logprobs, prompt_logprobs)
        verified = verify_drafts(logits, requests, self.input_batch.generators, self.device)
        self.input_batch.record_sampled(verified.row_token_ids, layout)
        observe_drafts(verified.row_token_ids)
        return PendingOutput(rids, None, wants_logprobs, prompt_logprobs, verified=verified)
