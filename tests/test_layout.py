"""The gateway's layers: no module imports from a layer above it, nor from a dialect it does not belong to."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"

# Lower layers first; a module may import only from layers below its own.
LAYERS = [
    {"codes", "settings", "metrics", "tracing", "healing"},
    {"wire", "audio", "journal", "overlap", "vad", "triton.launcher", "triton.stream", "page", "triton.endpoints",
     "triton.placement", "triton.decoupled", "triton.devices", "workers", "dialects.openai_objects"},
    {"limits", "triton.reload", "triton.orphans"},
    {"dialects.state", "dialects.openai_extensions", "inputs", "triton", "auth", "triton.supervisor", "triton.pool",
     "peers", "http_body", "stage_health"},
    {"registry", "fairness"},
    {"dialects.realtime_events", "dialects.openai_config", "dialects.openai_conversation", "dialects.openai_duplex"},
    {"dialects.openai_events"},
    {"dialects.openai_input", "dialects.openai_response"},
    {"dialects.openai_states", "dialects.openai_turns"},
    {"dialects.backend", "dialects.openai", "dialects.minicpm", "shell"},
    {"endpoints", "admin"},
    {"routes"},
    {"serve", "triton.__main__"},
]
# What each dialect may import from the dialects package besides itself.
DIALECTS = {
    "dialects.backend": {"dialects.state"},
    "dialects.minicpm": {"dialects.state", "dialects.realtime_events"},
    "dialects.openai": {"dialects.state", "dialects.realtime_events", "dialects.openai_events",
                        "dialects.openai_config", "dialects.openai_conversation", "dialects.openai_duplex",
                        "dialects.openai_input", "dialects.openai_states", "dialects.openai_response",
                        "dialects.openai_extensions", "dialects.openai_turns", "dialects.openai_objects"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(GATEWAY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The gateway modules a file imports (relative imports resolved)."""
    package = _module(path).split(".")[:-1] if path.name != "__init__.py" else _module(path).split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("gateway."):
                target = node.module.removeprefix("gateway.")
            else:
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" if target else n for n in names]
            found = [s for s in subs if (GATEWAY / f"{s.replace('.', '/')}.py").exists()]
            out.update(found or [target])
    return {m for m in out if m}


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module in layer)


def test_every_module_has_a_layer() -> None:
    modules = {_module(p) for p in GATEWAY.rglob("*.py")} - {"", "dialects"}
    assert modules <= set().union(*LAYERS), modules - set().union(*LAYERS)


def test_no_import_runs_upward_or_across_dialects() -> None:
    for path in GATEWAY.rglob("*.py"):
        module = _module(path)
        if module in ("", "dialects"):
            continue
        for target in _imports(path):
            if target in ("", "dialects"):
                continue
            assert _layer(target) < _layer(module), f"{module} imports {target}, a layer at or above its own"
            if module in DIALECTS and target.startswith("dialects."):
                assert target in DIALECTS[module], f"{module} imports {target}, another dialect's module"


def test_the_server_imports_no_client_library() -> None:
    """The gateway serves clients; it never imports the client library (`minicpmo_client`)."""
    for path in GATEWAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n.split(".")[0] == "minicpmo_client" for n in names), f"{path} imports the client library"
