"""`python -m export --preset tiny`: build each stage, export it to ONNX, check it, write the artefacts.

Artefacts land in the model repository's version folders (`model_repository/<stage>/1/`), ignored by git.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from minicpmo_triton.engine.tensorrt_build import NOT_BUILT
from minicpmo_triton.model_config import STAGE_CONFIG_FILE, PresetConfig
from minicpmo_triton.stages.token2wav import DEFAULT_VOICE_WAV
from minicpmo_triton.stages.voice_prompt import DEFAULT_REF_AUDIO

from .checkpoint import DEFAULT_VOICE, copy_causal_vocoder, copy_voice_assets
from .memory import memory_report
from .presets import TINY_SEED, get_preset
from .stages import STAGE_NAMES, build_modules, stage_files, stage_graphs

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRY_MODEL = "duplex"
DEMO_REF_AUDIO = Path(__file__).resolve().parent / "assets" / "ref_minicpm_signature.wav"
# Models earlier exports wrote and the project has since dropped. Git deletes their tracked config.pbtxt and
# model.py but leaves the ignored artefacts (1/model.onnx, 1/stage.json), and Triton would try to serve such a
# folder without its config; the export removes it.
RETIRED_MODELS = ("speaker_encoder",)  # replaced by token2wav's voice prompts (CAM++ inside token2wav)


def version_dir(repository: Path, model: str) -> Path:
    return repository / model / "1"


def remove_retired_models(repository: Path) -> None:
    for model in RETIRED_MODELS:
        if (repository / model).is_dir():
            shutil.rmtree(repository / model)
            print(f"removed {repository / model}: the retired {model} model's leftover artefacts")


def write_default_ref_audio(checkpoint: Path | None, folder: Path) -> None:
    """The duplex system prompt's voice reference when a session sends none: the checkpoint's own, else the
    demo's (export/assets/README.md)."""
    own = checkpoint / DEFAULT_VOICE if checkpoint is not None else None
    shutil.copy2(own if own is not None and own.exists() else DEMO_REF_AUDIO, folder / DEFAULT_REF_AUDIO)


def write_stage_configs(repository: Path, preset: PresetConfig) -> None:
    for model in (*STAGE_NAMES, ENTRY_MODEL):
        folder = version_dir(repository, model)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STAGE_CONFIG_FILE).write_text(preset.to_json(), encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    parser.add_argument("--preset", default="tiny", help="tiny (random weights) or minicpm-o-4.5")
    parser.add_argument("--checkpoint", type=Path, help="local checkpoint folder (required for minicpm-o-4.5)")
    parser.add_argument("--runtime", choices=("onnx", "tensorrt"), default="onnx",
                        help="tensorrt also compiles engines from the ONNX (needs a GPU)")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--seed", type=int, default=TINY_SEED)
    parser.add_argument("--max-batch", type=int, default=64, help="TensorRT profile's largest batch")
    parser.add_argument("--stages", nargs="*", default=list(STAGE_NAMES), choices=STAGE_NAMES)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = get_preset(args.preset)
    if args.runtime == "tensorrt":
        from minicpmo_triton.engine.tensorrt_build import NoGpuError, require_gpu

        try:
            require_gpu()
        except NoGpuError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    modules_seed = args.seed
    if preset.name != "tiny" and args.checkpoint is None:
        print(f"error: preset {preset.name} is built from a local checkpoint: pass --checkpoint DIR",
              file=sys.stderr)
        return 2
    if args.checkpoint is not None:
        import dataclasses

        from .checkpoint import (
            CheckpointError,
            copy_tokenizer,
            load_checkpoint,
            load_token2wav,
            read_config,
            require_tokenizer,
        )
        from .config import preset_from_config
        from .modules.token2wav import dims_of

        try:
            preset = preset_from_config(preset, read_config(args.checkpoint))
            if preset.tokenizer == "huggingface":
                require_tokenizer(args.checkpoint)
            token2wav = load_token2wav(args.checkpoint, preset.token2wav)  # assets/token2wav, beside the safetensors
            if token2wav is not None:
                preset = dataclasses.replace(preset, token2wav=dims_of(token2wav, preset.token2wav))
            modules = build_modules(preset, modules_seed, token2wav)
            loaded = load_checkpoint(args.checkpoint, modules, preset)
            if token2wav is not None:
                loaded.append("token2wav")
            if preset.tokenizer == "huggingface":
                copy_tokenizer(args.checkpoint, version_dir(args.model_repository, ENTRY_MODEL) / "tokenizer")
        except CheckpointError as exc:  # a report for a person, not a traceback
            print(f"error [{exc.code}]: cannot export {preset.name} from {args.checkpoint}:\n{exc}", file=sys.stderr)
            return 1
        missing = sorted(set(STAGE_NAMES) - set(loaded))
        print(f"loaded {', '.join(loaded)} from {args.checkpoint}"
              + (f"; random weights for {', '.join(missing)}" if missing else ""))
    else:
        modules = build_modules(preset, modules_seed)
    print(memory_report(preset))

    remove_retired_models(args.model_repository)
    write_stage_configs(args.model_repository, preset)
    voice_folder = version_dir(args.model_repository, "token2wav")
    (voice_folder / DEFAULT_VOICE_WAV).unlink(missing_ok=True)  # the default voice is the checkpoint's, or the export's
    copied = copy_voice_assets(args.checkpoint, voice_folder) if args.checkpoint is not None else []
    if copy_causal_vocoder(args.checkpoint, voice_folder):
        print("token2wav: minicpmo-utils 1.0.7's layout: its causal vocoder (config.yaml, hift.pt) is streamed in "
              "torch by the stage; vocoder.onnx is its original HiFT (hift_original.pt), not streamed")
    write_default_ref_audio(args.checkpoint, version_dir(args.model_repository, ENTRY_MODEL))
    graphs = [g for g in stage_graphs(preset, modules)
              if g.folder in args.stages and not (g.folder == "token2wav" and g.file in copied)]
    for rel, data in stage_files(preset, modules, modules_seed).items():
        if rel.split("/")[0] in args.stages:
            (args.model_repository / rel).parent.mkdir(parents=True, exist_ok=True)
            (args.model_repository / rel).write_bytes(data)
    from .onnx_export import ParityError, check_parity, export_onnx

    failures = []
    bar = tqdm(graphs, desc=f"export {preset.name}", unit="stage")
    for graph in bar:
        bar.set_postfix_str(graph.name)
        t0 = time.perf_counter()
        path = version_dir(args.model_repository, graph.folder) / graph.file
        export_onnx(graph, path)
        parity = check_parity(graph, path)
        status = "ok" if parity.ok else f"FAILED (tolerance {parity.tolerance:g})"
        tqdm.write(f"{graph.name:20s} onnx max|ort - torch| = {parity.max_abs_diff:.3g} {status} "
                   f"({time.perf_counter() - t0:.1f} s)")
        if not parity.ok:
            failures.append(parity)
        if args.runtime == "tensorrt" and graph.name not in NOT_BUILT:
            from minicpmo_triton.engine.tensorrt_build import build_engine, profiles

            build_engine(path, path.with_suffix(".plan"), profiles(graph.name, preset, args.max_batch))
            tqdm.write(f"{graph.name:20s} tensorrt engine written")
    if failures:
        raise ParityError(", ".join(f"{f.stage}: {f.max_abs_diff:.3g}" for f in failures))
    build_encoder_plans(args.model_repository, preset, args.stages)
    print(f"artefacts in {args.model_repository}")
    return 0


def build_encoder_plans(repository: Path, preset: PresetConfig, stages: list[str]) -> None:
    """Where a GPU, its driver and TensorRT are: the encoders' TensorRT plans now, as their first load on this GPU
    would build them (kept by hash: minicpmo_triton/engine/plan_cache.py), so the first serve does not wait for them."""
    import re

    from minicpmo_triton.engine.tensorrt_build import NoGpuError, require_gpu

    try:
        require_gpu()
    except NoGpuError:
        return
    from minicpmo_triton.engine.plan_cache import cached_plan

    for model in ("vision_encoder", "audio_encoder"):
        if model in stages:
            config = (repository / model / "config.pbtxt").read_text(encoding="utf-8")
            max_batch = int(re.search(r"^max_batch_size:\s*(\d+)", config, re.M)[1])  # type: ignore[index]
            path = cached_plan(version_dir(repository, model), "model", model, preset, max_batch)
            print(f"{model}: TensorRT plan {path.relative_to(repository)}")


if __name__ == "__main__":
    sys.exit(main())
