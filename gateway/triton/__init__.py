"""Triton from the gateway's side: `launcher` starts a real tritonserver, `stream` streams a session's
steps to the `duplex` model (request and events as `minicpmo_triton.duplex_contract` writes them)."""

from .launcher import (
    DEFAULT_MODEL_REPOSITORY,
    TritonInstall,
    TritonNotFound,
    TritonPorts,
    TritonServer,
    find_triton,
    free_port,
    free_ports,
)

__all__ = ["DEFAULT_MODEL_REPOSITORY", "TritonInstall", "TritonNotFound", "TritonPorts", "TritonServer",
           "find_triton", "free_port", "free_ports"]
