"""The runtime's layers (docs/architecture.md, "The runtime"): a module of `minicpmo_triton` imports only from its
own layer or the layers below, so the rules never reach for an engine, the stages never for Triton, and the gateway
sees only the contract."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "minicpmo_triton"
GATEWAY = RUNTIME.parent / "gateway"

# Lower layers first: a top-level module or a folder of `minicpmo_triton`, each in one layer.
LAYERS = [
    {"errors", "model_config"},  # what every layer shares: coded errors, a preset's dimensions and token ids
    {"rules"},  # the model's decode, chat, window and sampling rules: pure numpy
    {"stage_io", "duplex_contract"},  # what each stage takes and gives; the gateway's one contract with `duplex`
    {"media"},  # audio, images, PCM, tokenizers
    {"engine", "vocoder"},  # how a network runs: exported graphs, the device engine core; token2wav's vocoders
    {"stages"},  # the stage computations, free of Triton
    {"serving"},  # the Triton models, the entry model's BLS, the in-process pipeline
]
# What the gateway may import of the runtime (never torch, never a stage).
GATEWAY_MAY_IMPORT = {"errors", "model_config", "rules", "stage_io", "duplex_contract", "media"}


def _part(module: str) -> str:
    """The layer unit of a dotted module under minicpmo_triton: its folder, or itself at the top."""
    return module.split(".")[0]


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(RUNTIME).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, package: list[str] | None) -> set[str]:
    """The runtime modules a file imports (relative ones resolved within `package`, None: outside the runtime;
    imports for type checking only left out)."""
    skipped = {id(n) for t in ast.walk(tree) if _type_checking(t) for s in t.body for n in ast.walk(s)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom | ast.Import):
            continue
        if isinstance(node, ast.Import):
            names = [a.name.removeprefix("minicpmo_triton.") for a in node.names
                     if a.name.startswith("minicpmo_triton.")]
        elif node.level:
            if package is None:
                continue
            base = package[: len(package) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [".".join(target)] if target else [a.name for a in node.names]
        elif node.module and node.module.startswith("minicpmo_triton"):
            rest = node.module.removeprefix("minicpmo_triton").lstrip(".")
            names = [rest] if rest else [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n)
    return out


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def test_every_part_of_the_runtime_has_a_layer() -> None:
    parts = {_part(".".join(_module(p))) for p in RUNTIME.rglob("*.py")} - {""}
    assert parts <= set().union(*LAYERS), parts - set().union(*LAYERS)


def test_no_runtime_import_runs_upward() -> None:
    upward = []
    for path in RUNTIME.rglob("*.py"):
        module = _module(path)
        if not module:
            continue
        package = module if path.name == "__init__.py" else module[:-1]
        for target in _imports(ast.parse(path.read_text(encoding="utf-8")), package):
            if _layer(_part(target)) > _layer(module[0]):
                upward.append(f"{'.'.join(module)} -> {target}")
    assert not upward, upward


def test_the_gateway_imports_only_the_contract_side_of_the_runtime() -> None:
    seen = set()
    for path in GATEWAY.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        seen |= {_part(m) for m in _imports(tree, None) if m}
    assert seen and seen <= GATEWAY_MAY_IMPORT, seen - GATEWAY_MAY_IMPORT
