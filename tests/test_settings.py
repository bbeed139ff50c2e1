"""One source for every setting: the code's table (its defaults), each model's config.pbtxt, the environment
override and docs/settings.md cannot disagree."""

from __future__ import annotations

import ast
import re
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from gateway import settings as gateway_settings
from gateway.settings import TEST_FAULTS_PHRASE, Settings, env_name, env_setting
from minicpmo_triton.serving import stage_settings
from minicpmo_triton.serving.stage_settings import STAGE_SETTINGS, stage_setting
from minicpmo_triton.stages.token2wav import PROMPT_CACHE_MB
from minicpmo_triton.stages.voice_prompt import VOICES_DIR_ENV

ROOT = Path(__file__).resolve().parent.parent
PARAMETER = re.compile(r'\{\s*key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def config_parameters() -> dict[str, dict[str, str]]:
    return {p.parent.name: dict(PARAMETER.findall(p.read_text()))
            for p in sorted((ROOT / "model_repository").glob("*/config.pbtxt"))}


def test_every_config_pbtxt_parameter_is_in_the_table_with_its_default() -> None:
    models = config_parameters()
    assert set(models) == {"audio_encoder", "duplex", "llm", "tts", "token2wav", "vision_encoder"}
    for model, params in models.items():
        for key, value in params.items():
            assert key in STAGE_SETTINGS, f"{model}/config.pbtxt: {key} is in no table (minicpmo_triton/stage_settings)"
            s = STAGE_SETTINGS[key]
            assert model in s.models, f"{model}/config.pbtxt sets {key}, which the table says {model} does not read"
            assert value == s.default, f"{model}/config.pbtxt: {key} = {value!r}, the code's default {s.default!r}"
    for s in STAGE_SETTINGS.values():
        for model in s.models:
            assert s.key in models[model], f"{model}/config.pbtxt lacks {s.key} (default {s.default!r})"


def test_a_model_setting_comes_from_the_environment_then_config_pbtxt_then_the_default() -> None:
    assert stage_setting("llm_batch_window_ms", {}, env={}) == 250.0  # once 0.0 in code, 250 in config.pbtxt
    assert stage_setting("llm_batch_window_ms", {"llm_batch_window_ms": "100"}, env={}) == 100.0
    env = {"MINICPMO_LLM_BATCH_WINDOW_MS": "0"}
    assert stage_setting("llm_batch_window_ms", {"llm_batch_window_ms": "100"}, env=env) == 0.0
    assert stage_setting("bls_threads", {}, env={"MINICPMO_BLS_THREADS": ""}) == 256  # empty: not set
    for s in STAGE_SETTINGS.values():  # every key alike
        assert s.env == "MINICPMO_" + s.key.upper()
        assert stage_setting(s.key, {}, env={s.env: "7"}) == s.kind("7")
    # the constants the stages keep for callers outside Triton agree with the table
    assert float(STAGE_SETTINGS["voice_prompt_cache_mb"].default) == PROMPT_CACHE_MB
    assert STAGE_SETTINGS["voices_dir"].env == VOICES_DIR_ENV


def _other_than(kind: typing.Any, default: typing.Any) -> tuple[str, typing.Any]:
    """A value for the environment and what it should become, unlike the default."""
    if kind is bool:
        return ("0", False) if default else ("yes", True)
    if kind is int:
        return str(default + 3), default + 3
    if kind is float:
        return str(default + 1.5), default + 1.5
    if kind is str:
        return "elsewhere:1", "elsewhere:1"
    return "a, b", ("a", "b")


def test_every_gateway_setting_has_an_environment_override() -> None:
    types = typing.get_type_hints(Settings)
    for f in fields(Settings):
        raw, expected = _other_than(types[f.name], f.default)
        if f.name == "test_faults":
            raw, expected = TEST_FAULTS_PHRASE, True
        got = getattr(Settings.from_env({env_name(f.name): raw}), f.name)
        assert got == expected != f.default, (f.name, raw, got)
    assert Settings.from_env({}) == Settings()
    assert not Settings.from_env({"MINICPMO_TEST_FAULTS": "1"}).test_faults  # only the very phrase


def test_one_gateway_setting_comes_from_the_environment_as_the_table_reads_it() -> None:
    assert env_setting("triton_control_key", {}) == ""
    assert env_setting("triton_control_key", {"MINICPMO_TRITON_CONTROL_KEY": "k"}) == "k"
    assert env_setting("failover_s", {"MINICPMO_FAILOVER_S": "2.5"}) == 2.5


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """`os.environ.get("MINICPMO_X")`, `os.getenv(...)`, `os.environ["MINICPMO_X"]`, `"MINICPMO_X" in os.environ`."""
    named = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}

    def setting(node: ast.AST) -> str | None:  # a string, or a name given one (`CONTROL_KEY_ENV = "MINICPMO_..."`)
        value = node.value if isinstance(node, ast.Constant) else named.get(getattr(node, "id", ""))
        return value if isinstance(value, str) and value.startswith("MINICPMO_") else None

    def environ(node: ast.AST) -> bool:
        return getattr(node, "attr", getattr(node, "id", "")) == "environ"

    out = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "get" and environ(node.func.value))
                or getattr(node.func, "attr", getattr(node.func, "id", "")) == "getenv"):
            name = setting(node.args[0])
        elif isinstance(node, ast.Subscript) and environ(node.value):
            name = setting(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(o, ast.In) for o in node.ops) \
                and any(environ(c) for c in node.comparators):
            name = setting(node.left)
        if name is not None:
            out.append((node.lineno, name))
    return out


def test_no_setting_is_read_from_the_environment_outside_the_tables() -> None:
    """Each MINICPMO_ variable the servers and benchmarks read goes through a table (gateway/settings.py,
    minicpmo_triton/serving/stage_settings.py), so its default, parsing and docs row are the table's."""
    tables = {ROOT / "gateway" / "settings.py", ROOT / "minicpmo_triton" / "serving" / "stage_settings.py"}
    found = {str(path.relative_to(ROOT)): reads
             for package in ("gateway", "minicpmo_triton", "export", "bench") for path in (ROOT / package).rglob("*.py")
             if path not in tables and (reads := _environment_reads(ast.parse(path.read_text())))}
    assert found == {}


@pytest.mark.parametrize("module", [gateway_settings, stage_settings])
def test_docs_settings_holds_the_tables_printed_from_the_code(module: typing.Any) -> None:
    docs = (ROOT / "docs" / "settings.md").read_text()
    assert module.markdown_table() in docs, f"docs/settings.md: paste `python -m {module.__name__}`'s table"


INSTANCE_KIND = re.compile(r"instance_group \[ \{ count: \d+ kind: (KIND_\w+) \} \]")
MAX_BATCH = re.compile(r"^max_batch_size: (\d+)$", re.M)


def test_engine_models_take_a_gpu_where_there_is_one_and_decoders_batch_128() -> None:
    """KIND_AUTO: Triton makes it KIND_GPU (an instance per GPU) where its build sees GPUs, else KIND_CPU (the
    CPU binary here); the models then run the paged engines / TensorRT plans on that GPU. The entry model (BLS,
    no compute) stays on the CPU. The decoders batch at least 128 sessions a step."""
    configs = {p.parent.name: p.read_text() for p in (ROOT / "model_repository").glob("*/config.pbtxt")}
    kinds = {m: INSTANCE_KIND.findall(text) for m, text in configs.items()}
    assert kinds.pop("duplex") == ["KIND_CPU"]
    assert all(k == ["KIND_AUTO"] for k in kinds.values()), kinds
    for model in ("llm", "tts"):
        assert int(MAX_BATCH.findall(configs[model])[0]) >= 128
