"""Build a model on its device and fill it: safetensors (HF directory), GGUF, or random (dummy)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.model.registry import model_class
from kvserve.model.model_config import ModelConfig
from kvserve.ops.attention_backend import AttentionBackend

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' dtype names (the header's "dtype" field).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names the file (and the tensor, if one)."""


class CheckpointSlice:
    """A safetensors tensor not read yet: `narrow` only records the range, `load` reads just that range,
    so a tensor-parallel rank reads its own slice of each weight (host memory ~ its shard, not the model).
    `where` ("file: tensor") names it in errors."""

    def __init__(self, lazy, shape, ranges=None, where: str = "a safetensors tensor"):
        self._lazy = lazy
        self.shape = torch.Size(shape)
        self._ranges = ranges or [(0, n) for n in shape]
        self.where = where

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim %= len(self.shape)
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + length}) is outside dimension {dim} of size {self.shape[dim]}")
        base = self._ranges[dim][0]
        ranges = list(self._ranges)
        ranges[dim] = (base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointSlice(self._lazy, shape, ranges, self.where)

    def reshape(self, *shape) -> torch.Tensor:
        return self.load().reshape(*shape)

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype, from the file's header (nothing is read)."""
        name = self._lazy.get_dtype()
        if name not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.where} has dtype {name}, which kvserve does not read.")
        return _SAFETENSORS_DTYPES[name]

    def load(self) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            if not self.shape:  # a scalar
                return self._lazy[...]
            return self._lazy[tuple(slice(a, b) for a, b in self._ranges)]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.where} cannot be read ({e}); the file is truncated or corrupt: "
                                  f"download it again.") from None


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"No *.safetensors files in {model_dir}; save the model with safe_serialization=True.")
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} cannot be read as safetensors ({e}); the file is truncated or "
                                  f"corrupt: download it again.") from None
        with handle as f:
            for name in f.keys():
                try:
                    lazy = f.get_slice(name)
                    shape = lazy.get_shape()
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({e}); the file is "
                                          f"truncated or corrupt: download it again.") from None
                yield name, CheckpointSlice(lazy, shape, where=f"{file}: tensor {name!r}")


def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    # Small values keep activations finite through many layers, as real checkpoints do.
    # Drawn on the parameter's own device: an 8B model filled through the CPU would take minutes.
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if not param.is_floating_point() or param.element_size() == 1:
            _fill_dummy_quantized(name, param, gen)
        elif name.endswith("scales") or name.endswith("weight_scale"):
            # Dequantized weights of about the same +-1e-2 as the float dummy: int values reach +-8
            # (4-bit) and fp8 values +-448.
            param.data.fill_(1e-2 / (448 if name.endswith("weight_scale") else 8))
        else:
            param.data.uniform_(-1e-2, 1e-2, generator=gen)


def _fill_dummy_quantized(name: str, param: torch.nn.Parameter, gen: torch.Generator) -> None:
    """Packed int weights: random bit patterns (uniform 4/8-bit values); int zero points: every field at
    mid-range (8 or 128), so weights are centred; g_idx is left as created; fp8: uniform values; MXFP4: random
    bytes under small scales."""
    if name.endswith("g_idx"):
        return
    if name.endswith("qzeros"):
        bits = 32 // param.pack_factor
        word = 0
        for i in range(param.pack_factor):
            word |= (1 << (bits - 1)) << (i * bits)
        param.data.fill_(word - (1 << 32) if word >= 1 << 31 else word)
        return
    if param.dtype == torch.int32:
        param.data.copy_(torch.randint(-(1 << 31), (1 << 31) - 1, param.shape, generator=gen, device=param.device,
                                       dtype=torch.int64).to(torch.int32))
        return
    if param.dtype == torch.uint8:  # MXFP4 experts: random E2M1 pairs, E8M0 scales 2^-9 (weights up to ~1e-2)
        from kvserve.ops.mxfp4 import SCALE_BIAS

        if name.endswith("weight_scale"):
            param.data.fill_(SCALE_BIAS - 9)
        else:
            param.data.copy_(torch.randint(0, 256, param.shape, generator=gen, device=param.device,
                                           dtype=torch.int32).to(torch.uint8))
        return
    param.data.copy_(torch.empty(param.shape, device=param.device).uniform_(-448, 448, generator=gen).to(param.dtype))


def load_model(
    cfg: ModelConfig,
    model_path: Path,
    load_format: str,
    dtype: str,
    device: str,
    backend: AttentionBackend,
    max_positions: int,
    seed: int = 0,
    layer_range: tuple[int, int] | None = None,
    quant_config=None,
) -> torch.nn.Module:
    model_cls = model_class(cfg.architecture)
    torch_dtype = DTYPES[dtype]
    # Float parameters are created in the serving dtype (a linear method may choose others: those stay);
    # rotary caches are built in fp32 explicitly (HF computes cos/sin in fp32 too).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg, backend, max_positions, layer_range, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)

    if load_format == "dummy":
        _fill_dummy(model, seed)
        _process_weights_after_loading(model)
        return model.eval()
    if load_format == "gguf" or (load_format == "auto" and model_path.suffix == ".gguf"):
        from kvserve.model.gguf_loader import iter_gguf_weights

        weights = iter_gguf_weights(model_path)
    else:
        weights = iter_safetensors_weights(model_path)
        if quant_config is not None:
            weights = quant_config.read_weights(weights, model_path, torch_dtype, device)
    try:
        loaded = model.load_weights(weights)
    except ValueError as e:  # the model names the tensor; say which checkpoint it came from
        if str(model_path) in str(e):
            raise
        raise ValueError(f"{model_path}: {e}") from None
    missing = {n for n, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"The checkpoint at {model_path} lacks the tensors of {len(missing)} parameters, e.g. "
                         f"{', '.join(sorted(missing)[:5])}; is it complete (every *.safetensors shard present)?")
    _process_weights_after_loading(model)
    return model.eval()


def _process_weights_after_loading(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def weight_bytes(model: torch.nn.Module) -> int:
    """Real bytes of the weights as served (packed int4 at half a byte per value, fp8 at one)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
