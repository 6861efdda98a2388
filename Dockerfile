# syntax=docker/dockerfile:1
# duospec image: Ray's GPU image + duospec + the bundled models (at /opt/duospec/models).
#
#   docker build -t duospec:0.1.0 .
#
# Used by every pod of deploy/kuberay (head and GPU workers). The Ray version must be the one in
# deploy/cluster.yaml's docker image and raycluster.yaml's rayVersion (tests/test_deploy.py checks).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu

# Build the wheel in a throwaway stage, so the final image carries the installed package only.
FROM ${RAY_IMAGE} AS wheel
WORKDIR /tmp/duospec-src
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users duospec ./duospec
COPY --chown=ray:users coordinator ./coordinator
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users draft_worker ./draft_worker
COPY --chown=ray:users target_worker ./target_worker
RUN pip wheel --no-deps --wheel-dir /tmp/wheels .

FROM ${RAY_IMAGE}
USER root
# The serve config's ledger folder (deploy/serve.yaml); on Kubernetes a volume is mounted over it.
RUN mkdir -p /var/lib/duospec && chown ray:users /var/lib/duospec
USER ray
# Models change less often than code: copied before the package so a code change reuses this layer.
COPY --chown=ray:users models /opt/duospec/models
ENV DUOSPEC_MODELS=/opt/duospec/models
# torch and the other dependencies come from PyPI here (Linux torch wheels are CUDA builds); the
# pip cache mount keeps them across rebuilds.
RUN --mount=type=bind,from=wheel,source=/tmp/wheels,target=/tmp/wheels \
    --mount=type=cache,target=/home/ray/.cache/pip,uid=1000,gid=100 \
    pip install "$(ls /tmp/wheels/duospec-*.whl)[serve]"
# gRPC (duospec.v1.GenerationService, health, reflection), the OpenAI-compatible HTTP API, Prometheus metrics.
EXPOSE 50051 8000 9400
