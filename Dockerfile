# minicpmo-triton on NVIDIA's Triton image (docs/deploy.md, "The container").
#
# nvcr.io/nvidia/tritonserver:24.12-py3 is Triton 2.53 on Ubuntu 24.04 with Python 3.12: the first NGC Triton
# image whose Python is inside pyproject.toml's requires-python (>=3.11,<3.13). Up to 24.11 the images run
# Python 3.10, which lacks typing.Self and reached its end of life in October 2026. CI runs Triton 2.51
# (nvidia-pytriton 0.7.0, the newest on PyPI) on Python 3.11, and the torch-free tests on this image's PYTHON;
# 24.12 is the Triton nearest 2.51 on a supported Python.
#
#   docker build -t minicpmo-triton .        the CPU tests run first (stage `tests`): no image unless they pass
#   docker run --gpus all --shm-size=2g -p 8006:8006 -e MINICPMO_API_KEYS=a-long-key minicpmo-triton
#
# One image, three roles: `python3 -m gateway.serve` (the default: Triton and a gateway together), Triton alone
# (`python3 -m gateway.triton --address 0.0.0.0`) and gateways alone (`python3 -m gateway.serve --triton-url
# ...`): deploy/compose.yaml, deploy/kubernetes/.
ARG NGC_TRITON=24.12
FROM nvcr.io/nvidia/tritonserver:${NGC_TRITON}-py3 AS runtime
ARG PYTHON=3.12
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# What scripts/setup.sh installs with apt, less what only tests and benches use (chromium, prometheus, libb64-0d).
# Not pinned (DL3008): the image's Ubuntu archive drops superseded versions, so a pin breaks the build, not the bugs.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends espeak-ng libsndfile1 \
 && rm -rf /var/lib/apt/lists/*

# Packages go into the image's own Python, the one Triton's Python backend stub embeds (a venv would be a
# second one); the image is single-purpose, so PEP 668's guard is lifted.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '${PYTHON}', 'Python ' + v"

WORKDIR /opt/minicpmo-triton
COPY pyproject.toml README.md ./
COPY minicpmo_triton ./minicpmo_triton
COPY minicpmo_client ./minicpmo_client
COPY export ./export
COPY gateway ./gateway
COPY model_repository ./model_repository
COPY bench ./bench
COPY scripts ./scripts

# As scripts/setup.sh does, less the `server` extra (this image's tritonserver is used: found on PATH) and with
# TensorRT (`gpu`); PyPI's torch for Linux x86_64 is the CUDA build. minicpmo-utils and silero-vad go in with
# --no-deps (why: docs/internals.md, pyproject.toml); tests/test_deploy.py keeps these pins equal to theirs. pip itself
# refuses this Python if requires-python does not admit it.
RUN python3 -m pip install -e ".[export,gpu]" \
 && python3 -m pip install --no-deps minicpmo-utils==1.0.7 silero-vad==6.2.3 \
 && python3 -m export --preset tiny

# The tests' CPU subset, at build time (no GPU then: Triton runs the tiny models' CPU instances). Left to CI: the
# browser page's test (chromium) and the fleet of two tritonservers.
FROM runtime AS tests
COPY tests ./tests
RUN python3 -m pip install -e ".[test]" \
 && python3 -m pytest -q -x -m "not fleet" --ignore=tests/test_page_browser.py \
 && touch /tmp/tests-passed

FROM runtime
COPY --from=tests /tmp/tests-passed /tmp/tests-passed
EXPOSE 8006 8000 8001 8002
CMD ["python3", "-m", "gateway.serve", "--host", "0.0.0.0", "--port", "8006"]
