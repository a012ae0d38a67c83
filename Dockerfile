# inferq image: the API, a worker, or `inferq status` — one image, the command picks the role.
#
#   docker build -t inferq:cpu .                                              # CPU torch
#   docker build -t inferq:cuda --build-arg INFERQ_TORCH_SPEC="torch==2.11.0" \
#                --build-arg TORCH_INDEX_URL= .                               # CUDA torch
#
# The project is installed exactly as on a bare machine: scripts/env.sh (venv, pinned torch
# first, then `pip install -e .[extras]`, then the default model's wheel). CUDA needs no CUDA
# base image: PyPI's Linux torch wheels carry the CUDA runtime, and the NVIDIA container
# toolkit mounts the driver (docker-compose.yml reserves the GPU).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Torch wheel and where it comes from: the CPU index by default (PyPI's default Linux wheel is
# the multi-GB CUDA build); set TORCH_INDEX_URL empty for the CUDA build from PyPI.
ARG INFERQ_TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
ARG INFERQ_EXTRAS="gpu"

# gcc: Triton compiles a small C launcher the first time a kernel runs on the GPU; g++: the CPU
# path builds its attention kernel and TorchInductor compiles the forward's glue at start-up.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 inferq \
 && mkdir -p /opt/inferq /models \
 && chown inferq:inferq /opt/inferq /models
USER inferq
WORKDIR /opt/inferq

ENV INFERQ_VENV=/opt/inferq/.venv \
    INFERQ_HOME=/models \
    HF_HOME=/models/hf \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE

# Dependencies first (cached while only the source changes): env.sh needs pyproject.toml and
# the package folders to exist for the editable install.
COPY --chown=inferq:inferq pyproject.toml README.md ./
COPY --chown=inferq:inferq scripts/env.sh scripts/env.sh
COPY --chown=inferq:inferq schemas schemas
COPY --chown=inferq:inferq kernels kernels
COPY --chown=inferq:inferq engine engine
COPY --chown=inferq:inferq redis_io redis_io
COPY --chown=inferq:inferq worker worker
COPY --chown=inferq:inferq producer_api producer_api
COPY --chown=inferq:inferq cli cli
COPY --chown=inferq:inferq bench bench
RUN if [ -n "$TORCH_INDEX_URL" ]; then export PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL"; fi \
 && INFERQ_EXTRAS="$INFERQ_EXTRAS" INFERQ_TORCH_SPEC="$INFERQ_TORCH_SPEC" bash scripts/env.sh \
 && rm -rf /home/inferq/.cache/pip

ENV PATH=/opt/inferq/.venv/bin:$PATH
EXPOSE 8000
# Models (the converted default model, HF downloads) live in /models: mount a volume there.
VOLUME ["/models"]
CMD ["inferq", "api", "--host", "0.0.0.0", "--port", "8000"]
