"""kvserve: a paged-KV, continuously batching LLM inference engine with vLLM's interface."""

from kvserve.config import EngineArgs
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and the model code; import it lazily so `import kvserve` stays cheap.
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]
