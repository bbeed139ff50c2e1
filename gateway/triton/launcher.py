"""Start a real `tritonserver` on this machine: from PATH (the NGC image) or the nvidia-pytriton wheel.

`python -m gateway.triton --model-repository model_repository` runs it in the foreground.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..settings import env_name, env_setting

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_WORK_DIR = REPO_ROOT / ".triton_work"
LOOPBACK = "127.0.0.1"
# Triton's model control calls (load, unload) need this header with the control key, when one is set
CONTROL_HEADER = "minicpmo-control-key"
CONTROL_KEY_ENV = env_name("triton_control_key")
OTLP_ENDPOINT_ENV = env_name("otlp_endpoint")  # the gateway's and the entry model's setting, and Triton's tracer's


class TritonNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_source: Path | None  # the wheel's backends/ folder, or None for a system install
    lib_dir: Path | None  # the wheel's bundled shared libraries
    stub: Path | None  # python backend stub built for this interpreter


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    metrics: int

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def endpoint(self) -> str:
        """As the gateway lists it (gateway.triton.endpoints): gRPC address and metrics port."""
        return f"{self.grpc_url} metrics={self.metrics}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports() -> TritonPorts:
    return TritonPorts(http=free_port(), grpc=free_port(), metrics=free_port())


def find_triton() -> TritonInstall:
    """Prefer the pytriton wheel in this environment; fall back to `tritonserver` on PATH (NGC)."""
    try:
        import pytriton  # only located, never used for its API

        pkg = Path(pytriton.__path__[0]) / "tritonserver"
        binary = pkg / "bin" / "tritonserver"
        if binary.exists():
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            stub = pkg / "python_backend_stubs" / version / "triton_python_backend_stub"
            if not stub.exists():
                raise TritonNotFound(f"nvidia-pytriton has no Python backend stub for Python {version}")
            libs = Path(sysconfig.get_paths()["purelib"]) / "nvidia_pytriton.libs"
            return TritonInstall(binary, pkg / "backends", libs if libs.exists() else None, stub)
    except ImportError:
        pass
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), None, None, None)
    raise TritonNotFound(
        "tritonserver not found: install the server extra (pip install 'minicpmo-triton[server]') "
        "or run inside the NGC tritonserver image"
    )


def assemble_backends(install: TritonInstall, work_dir: Path) -> Path | None:
    """Copy the wheel's backends and drop in the stub matching this interpreter (what pytriton does)."""
    if install.backend_source is None:
        return None
    target = work_dir / "backends"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(install.backend_source, target)
    assert install.stub is not None
    shutil.copy2(install.stub, target / "python" / "triton_python_backend_stub")
    return target


def server_environment(install: TritonInstall) -> dict[str, str]:
    env = dict(os.environ)
    if install.lib_dir is not None:
        # The stub embeds this interpreter: its libpython too, where the system has none (pyenv's 3.12, say).
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(install.lib_dir), env.get("LD_LIBRARY_PATH"),
                                                        sysconfig.get_config_var("LIBDIR")]))
    # The stub's embedded Python finds this environment's packages through PATH.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = ":".join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # Stage models run one onnxruntime session each; keep BLAS from oversubscribing small machines.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def server_command(
    install: TritonInstall,
    model_repository: Path,
    ports: TritonPorts,
    backend_dir: Path | None,
    log_verbose: int = 0,
    address: str = LOOPBACK,
    model_control: str = "explicit",
    control_key: str = "",
    otlp_endpoint: str = "",
) -> list[str]:
    cmd = [
        str(install.binary),
        f"--model-repository={model_repository}",
        # Triton's own default is every interface: its models would be reachable around the gateway.
        f"--http-address={address}",
        f"--grpc-address={address}",
        f"--metrics-address={address}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--allow-cpu-metrics=false",
        f"--log-verbose={log_verbose}",
        # Stubs of a large model can take a while to load their engines.
        "--backend-config=python,shm-default-byte-size=16777216",
        "--backend-config=python,shm-growth-byte-size=16777216",
        "--exit-timeout-secs=10",
        # explicit: every model loaded at start, and each one reloadable on its own through the model control API:
        # a stage whose stub died is healed by reloading that model, not the whole server (gateway/triton/reload.py)
        f"--model-control-mode={model_control}",
    ]
    if model_control == "explicit":
        cmd.append("--load-model=*")
    if control_key:  # whoever reaches Triton's ports may infer, but not unload or load models without it
        cmd += [f"--grpc-restricted-protocol=model-repository:{CONTROL_HEADER}={control_key}",
                f"--http-restricted-api=model-repository:{CONTROL_HEADER}={control_key}"]
    if backend_dir is not None:
        cmd.append(f"--backend-directory={backend_dir}")
    return cmd + trace_flags(otlp_endpoint)


def trace_flags(otlp_endpoint: str) -> list[str]:
    """Triton's OpenTelemetry tracing, for the requests that carry a trace context only (rate 0: the gateway's
    traced steps, each on a stream whose headers carry it; docs/deploy.md, "Traces"). None without an endpoint."""
    if not otlp_endpoint:
        return []
    return ["--trace-config=mode=opentelemetry", "--trace-config=level=TIMESTAMPS", "--trace-config=rate=0",
            "--trace-config=count=-1", f"--trace-config=opentelemetry,url={otlp_endpoint.rstrip('/')}/v1/traces",
            "--trace-config=opentelemetry,resource=service.name=triton",
            "--trace-config=opentelemetry,bsp_schedule_delay=1000"]


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the process that started it dies, so none is left behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


SHM_DIR = Path("/dev/shm")
STUB_REGION_PREFIX = "triton_python_backend_shm_region_"


def stub_regions(pgid: int) -> set[str]:
    """The shared-memory regions of the Python backend stubs in this process group (each stub is started with
    its region's name). A stub or server killed with SIGKILL never unlinks its region: 16 MiB of RAM each, in
    /dev/shm, until someone does."""
    names: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile, or not ours to read
        names.update(a.decode() for a in args if a.startswith(STUB_REGION_PREFIX.encode()))
    return names


class TritonServer:
    """A `tritonserver` child process on given ports."""

    def __init__(
        self,
        model_repository: Path = DEFAULT_MODEL_REPOSITORY,
        ports: TritonPorts | None = None,
        work_dir: Path = DEFAULT_WORK_DIR,
        log_path: Path | None = None,
        log_verbose: int = 0,
        address: str = LOOPBACK,
        model_control: str = "explicit",
        control_key: str | None = None,
        otlp_endpoint: str | None = None,
    ) -> None:
        self.address = address
        self.otlp_endpoint = env_setting("otlp_endpoint") if otlp_endpoint is None else otlp_endpoint
        self.model_control = model_control
        self.control_key = env_setting("triton_control_key") if control_key is None else control_key
        self.model_repository = Path(model_repository).resolve()
        self.ports = ports or free_ports()
        self.work_dir = Path(work_dir)
        self.log_path = log_path
        self.log_verbose = log_verbose
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._regions: set[str] = set()  # its stubs' shared memory, unlinked by `reap` (see stub_regions)

    def start(self) -> None:
        install = find_triton()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        backend_dir = assemble_backends(install, self.work_dir / f"run-{self.ports.grpc}")
        cmd = server_command(install, self.model_repository, self.ports, backend_dir, self.log_verbose,
                             self.address, self.model_control, self.control_key, self.otlp_endpoint)
        stdout = None
        if self._log_file is not None:
            self._log_file.close()
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")  # lives as long as the process
            stdout = self._log_file
        self.process = subprocess.Popen(
            cmd, env=server_environment(install), stdout=stdout, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )

    def is_ready(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.ports.http}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode}; {self._log_hint()}")
            if self.is_ready():
                self.note_regions()  # every stub is up: a stub that dies later is still known
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s; {self._log_hint()}")

    def _log_hint(self) -> str:
        return f"see {self.log_path}" if self.log_path else "see its output above"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.reap()

    def kill(self) -> None:
        """Kill the whole server now (its stubs with it); whoever waits on the process (the supervisor) reaps it."""
        if self.process is not None and self.process.poll() is None:
            self.note_regions()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def note_regions(self) -> None:
        """Remember its stubs' regions now (a stub started since, by a model reload, too), for `reap`."""
        if self.process is not None:
            self._regions |= stub_regions(self.process.pid)

    def reap(self) -> None:
        """Whatever is left of the server: its process group (the Python backend stubs it forked) killed, the
        process itself waited for (no zombie)."""
        if self.process is None:
            return
        self.note_regions()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # start_new_session: the group id is its pid
        self.process.wait()
        for name in self._regions:  # after a clean exit the stubs unlinked their own: nothing left to do
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
        self._regions = set()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> TritonServer:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def control_refusal(address: str, model_control: str, control_key: str, insecure: bool) -> str | None:
    """Why Triton will not be started as asked, or None: in explicit model control mode, reachable from other
    hosts and with no control key, anyone who reaches its ports could unload its models."""
    if model_control != "explicit" or control_key or insecure or is_loopback(address):
        return None
    return (f"refusing to serve on {address} in explicit model control mode with no {CONTROL_KEY_ENV}: anyone who "
            "reaches its ports could unload a model. Set it (its gateways need the same key; docs/deploy.md), bind "
            "127.0.0.1, or pass --insecure.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.triton",
                                     description="Run tritonserver on the minicpmo-triton model repository")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--address", default=LOOPBACK, help="interface Triton binds to (0.0.0.0: all of them)")
    parser.add_argument("--model-control-mode", default="explicit", choices=("explicit", "none", "poll"),
                        help="explicit (default): a gateway heals a stage whose stub died by reloading its model")
    parser.add_argument("--insecure", action="store_true",
                        help=f"serve explicit model control beyond loopback with no {CONTROL_KEY_ENV}")
    args = parser.parse_args(argv)
    why = control_refusal(args.address, args.model_control_mode, env_setting("triton_control_key"), args.insecure)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    server = TritonServer(
        args.model_repository,
        TritonPorts(args.http_port, args.grpc_port, args.metrics_port),
        log_verbose=args.log_verbose,
        address=args.address,
        model_control=args.model_control_mode,
    )
    server.start()
    assert server.process is not None
    try:
        return server.process.wait()
    except KeyboardInterrupt:
        server.stop()
        return 0

