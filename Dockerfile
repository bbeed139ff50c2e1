# minicpmo-triton on NVIDIA's Triton image (24.10 = Triton 2.51, the server version this project tests on).
# Build: docker build -t minicpmo-triton .
# Run:   docker run --gpus all --shm-size=2g -p 8006:8006 minicpmo-triton
# The image exports the tiny preset at build time; mount a checkpoint and run
# `python3 -m export --preset minicpm-o-4.5 --checkpoint /ckpt --runtime tensorrt` for the real model.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends espeak-ng libsndfile1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/minicpmo-triton
COPY pyproject.toml README.md ./
COPY minicpmo_triton ./minicpmo_triton
COPY export ./export
COPY gateway ./gateway
COPY model_repository ./model_repository
COPY bench ./bench

# The image's own tritonserver and Python backend are used (found on PATH), so no `server` extra.
# On Linux x86_64, PyPI's torch wheel is the CUDA build; TensorRT comes with the `gpu` extra.
# silero-vad (server VAD on /v1/realtime) with --no-deps: the gateway reads its ONNX file, never its torch code.
RUN python3 -m pip install --no-cache-dir -e ".[export,gpu]" \
 && python3 -m pip install --no-cache-dir --no-deps silero-vad==6.2.3 \
 && python3 -m export --preset tiny

EXPOSE 8006 8000 8001 8002
CMD ["python3", "-m", "gateway.serve", "--host", "0.0.0.0", "--port", "8006"]
