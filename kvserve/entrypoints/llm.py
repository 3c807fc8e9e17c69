"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.openai.chat_renderer import (
    DEFAULT_TIMEOUT_S,
    ChatTemplateError,
    ChatTemplateRenderer,
    ChatTemplateTimeout,
)
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`chat_template_timeout`: seconds a chat template may take to render one conversation in `chat`
    (the server's --chat-template-timeout); the other keyword arguments are EngineArgs."""

    def __init__(self, model: str | None = None, chat_template_timeout: float = DEFAULT_TIMEOUT_S, **kwargs):
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}. See EngineArgs for the list.")
        self._init(LLMEngine(EngineArgs(model=model, **kwargs)), chat_template_timeout)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, chat_template_timeout: float = DEFAULT_TIMEOUT_S) -> "LLM":
        llm = cls.__new__(cls)
        llm._init(LLMEngine(args), chat_template_timeout)
        return llm

    def _init(self, engine: LLMEngine, chat_template_timeout: float) -> None:
        if not chat_template_timeout > 0:
            raise ValueError(f"chat_template_timeout must be > 0 seconds, got {chat_template_timeout!r}.")
        self.llm_engine = engine
        self.chat_template_timeout = chat_template_timeout
        self._chat_renderer: ChatTemplateRenderer | None = None  # started by the first chat()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults, used when none are passed (as in vLLM)."""
        return SamplingParams(**self.llm_engine.config.default_sampling)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; results come back in input order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {len(prompts)} prompts: pass one, or one per prompt."
                )
        engine = self.llm_engine
        # Offline, only the final outputs matter, whatever output_kind the caller set.
        final = {}
        for params in params_list:
            if id(params) not in final:
                engine.check_structured_outputs(params)  # an invalid constraint: ValueError before any request runs
                final[id(params)] = params.clone()
                final[id(params)].output_kind = RequestOutputKind.FINAL_ONLY
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(engine.add_request(None, prompt, final[id(params)]))
        except Exception:
            engine.abort_request(ids)  # all or nothing: no orphans left in the engine
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations.

        The template (the tokenizer's, or `chat_template`) is rendered by transformers in a sandboxed
        jinja2 environment, so a template cannot reach Python internals, and in a worker process with the
        server's limits (time: `chat_template_timeout`, memory, output size), so it cannot hang or exhaust
        this one. `continue_final_message` leaves the last (assistant) message open for the model to continue."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; skip_tokenizer_init is set.")
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError("This tokenizer has no chat template: pass chat_template=... (a jinja2 string).")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False.")
        kwargs = dict(chat_template_kwargs or {})
        for name in ("tokenize", "chat_template", "add_generation_prompt", "continue_final_message", "return_dict"):
            if name in kwargs:
                raise ValueError(f"chat_template_kwargs may not set {name}; pass it as chat()'s own argument.")
        kwargs.update(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message)
        if tools is not None:
            kwargs["tools"] = tools
        renderer = self._renderer()
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text = renderer.render_sync(conversation, **kwargs)
            except ChatTemplateTimeout as e:
                raise ValueError(f"Conversation {i}: {e}; the template loops or is too slow. Fix the template, or "
                                 f"raise the limit with LLM(..., chat_template_timeout=SECONDS).") from None
            except ChatTemplateError as e:
                raise ValueError(f"The chat template could not render conversation {i}: {e}") from None
            # The template already wrote any BOS it wants.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _renderer(self) -> ChatTemplateRenderer:
        """The server's renderer: templates run in a worker process with its time, memory and size limits."""
        if self._chat_renderer is None:
            self._chat_renderer = ChatTemplateRenderer(self.get_tokenizer(), timeout_s=self.chat_template_timeout)
        return self._chat_renderer

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        if pbar is not None:
                            pbar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [results[i] for i in ids]
