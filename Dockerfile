# flexrun image: the launcher, the store and the training library, with etcd support.
#   docker build -t flexrun:0.1.0 .                                  # CUDA torch from PyPI
#   docker build --build-arg TORCH_SPEC="torch==2.13.0" \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t flexrun:cpu .
#   docker build --build-arg RDMA=1 -t flexrun:rdma .               # + rdma-core/libibverbs:
#       NCCL over InfiniBand/RoCE (with spec.network.rdma / hostNetwork in the job spec)
# Your training image can start FROM this one and COPY its script in.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# The same install steps as the README (`pip install -e '.[...]'`), as a wheel.
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_SPEC="torch>=2.10"
ARG TORCH_INDEX=""
ARG RDMA=0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if [ -n "$TORCH_INDEX" ]; then python -m pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"; \
    else python -m pip install "$TORCH_SPEC"; fi
RUN if [ "$RDMA" = "1" ]; then apt-get update \
      && apt-get install -y --no-install-recommends rdma-core libibverbs1 ibverbs-providers \
      && rm -rf /var/lib/apt/lists/*; fi
COPY --from=build /wheels /wheels
RUN python -m pip install "$(ls /wheels/flexrun-*.whl)[etcd]" && rm -rf /wheels
RUN useradd --create-home --uid 10001 flexrun && mkdir -p /checkpoints && chown flexrun /checkpoints
USER 10001
WORKDIR /home/flexrun
# 29400: `flexrun store`. Workers need no fixed port (each round picks a fresh MASTER_PORT).
EXPOSE 29400
ENTRYPOINT ["flexrun"]
CMD ["--help"]
