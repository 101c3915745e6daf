# SpecPipe image for GPU nodes: CUDA runtime + the CUDA build of torch 2.13.0 (PyPI's default for linux/x86_64).
# Build from the repository root:
#   docker build -t ghcr.io/specpipe/specpipe:0.1.0 .
#   docker push ghcr.io/specpipe/specpipe:0.1.0
# Both entrypoints are the `specpipe` command: `specpipe stage ...`, `specpipe coordinator ...`.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip make ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/specpipe
COPY . .
# The install step is the Makefile's own, without the test tools and helm (tests/test_images.py checks it).
RUN make install-runtime PY=python3 VENV=/opt/venv && rm -rf /root/.cache/pip
ENV PATH=/opt/venv/bin:$PATH \
    SPECPIPE_LOG_FORMAT=json \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

USER 65532:65532
ENTRYPOINT ["specpipe"]
