"""Caches that outlive the process: Triton's kernels and autotuning results, torch's compile artifacts.

A fresh process pays again what an earlier one already paid: Triton compiles and autotunes its kernels (the
fast path's Gated DeltaNet kernels, fla's), and Inductor compiles ``compile_steps``'s regions. Both keep
on-disk caches; `enable_persistent_caches` points them at one folder the user can find, set and clear:

    RAINCHECK_CACHE_DIR (default: $XDG_CACHE_HOME/raincheck_hf, else ~/.cache/raincheck_hf)
      current/manifest.json   what the entries were built with (versions, GPU, CUDA)
      current/triton/         TRITON_CACHE_DIR (kernels and, with TRITON_CACHE_AUTOTUNING=1, autotuning results)
      current/inductor/       TORCHINDUCTOR_CACHE_DIR (FX graph and AOTAutograd caches, Inductor's autotuning,
                              Dynamo's automatic-dynamic profiles)
      current/torch_compile_artifacts.bin   torch.compiler.save_cache_artifacts after a warm-up, loaded at start,
                              only where the user's own TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR keep those
                              caches elsewhere (`artifacts_needed`)
      stale/<time>-<reason>/  folders set aside: built with other versions or another GPU, or unreadable

A cache built by other versions of torch / Triton / fla / transformers / raincheck_hf, or on another GPU or
CUDA version, is never trusted: its manifest says what built it, a mismatch (or a manifest that cannot be
read) moves the folder to ``stale/`` and a new one is started. Nothing happens at import; the CLI and the
server call `enable_persistent_caches` at start, and `raincheck_hf.warm_up` does. It sets the environment
variables above for this process only, and only those the user has not set (a user's own setting wins and is
reported); Triton and Inductor read them when they first compile, so call it before the first compile.
``python -m raincheck_hf cache info`` / ``cache clear`` show and empty the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
ARTIFACTS = "torch_compile_artifacts.bin"
FORMAT = 1  # the manifest's layout; another value is stale
ENV_DIRS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
ENV_FLAGS = {"TRITON_CACHE_AUTOTUNING": "1"}  # fla's autotuned kernels keep their results in Triton's cache

_LOCK = threading.Lock()
_ENABLED: dict[str, "PersistentCaches"] = {}


def default_cache_dir() -> Path:
    """``RAINCHECK_CACHE_DIR``, else ``$XDG_CACHE_HOME/raincheck_hf``, else ``~/.cache/raincheck_hf``."""
    given = os.environ.get("RAINCHECK_CACHE_DIR")
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "raincheck_hf"


def _version(module: str) -> str | None:
    from importlib import metadata

    for name in {"fla": ("flash-linear-attention", "fla-core")}.get(module, (module,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def fingerprint() -> dict:
    """What a cache entry depends on: the versions of torch, Triton, fla, transformers and raincheck_hf, the GPU's
    name and CUDA's version (None where absent)."""
    import torch

    from . import __version__

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"format": FORMAT, "torch": torch.__version__, "triton": _version("triton"), "fla": _version("fla"),
            "transformers": _version("transformers"), "raincheck_hf": __version__, "gpu": gpu,
            "cuda": torch.version.cuda}


@dataclass
class PersistentCaches:
    """The cache folder in use (`enable_persistent_caches`).

    Attributes:
        root: the folder (``current/`` and ``stale/`` inside).
        entries: ``current/``, whose manifest matches this process.
        set_aside: the folder moved to ``stale/`` at this start, with why, or None.
        env: the environment variables set for this process (name -> value).
        user_env: those the user had set already (left alone; name -> their value).
        loaded_artifacts: whether torch's compile artifacts of an earlier process were loaded (`artifacts_needed`).
    """

    root: Path
    entries: Path
    set_aside: tuple[Path, str] | None = None
    env: dict = field(default_factory=dict)
    user_env: dict = field(default_factory=dict)
    loaded_artifacts: bool = False


def _read_manifest(folder: Path) -> dict | None:
    """The manifest, or None when it is missing, not JSON, or not a dict with a fingerprint."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("fingerprint"), dict):
        return None
    return data


def check(folder: Path, expected: dict) -> str | None:
    """Why the entries in ``folder`` must not be used with fingerprint ``expected``, or None when they may."""
    if not folder.exists():
        return None
    data = _read_manifest(folder)
    if data is None:
        return "unreadable manifest" if (folder / MANIFEST).exists() else "no manifest"
    found = data["fingerprint"]
    changed = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
    if changed:
        return "built with another " + ", ".join(changed)
    return None


def _set_aside(root: Path, folder: Path, reason: str) -> Path:
    stale = root / "stale"
    stale.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in reason)[:60]
    target = stale / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{slug}"
    folder.rename(target)
    return target


def prepare(root, expected: dict | None = None) -> tuple[Path, tuple[Path, str] | None]:
    """``root/current`` ready for entries built with ``expected`` (default `fingerprint`): a mismatching or
    unreadable one moved to ``root/stale/`` first. Returns ``(current, (stale folder, reason) or None)``."""
    root = Path(root).expanduser()
    expected = fingerprint() if expected is None else expected
    current = root / "current"
    set_aside = None
    reason = check(current, expected)
    if reason is not None:
        set_aside = (_set_aside(root, current, reason), reason)
    current.mkdir(parents=True, exist_ok=True)
    if _read_manifest(current) is None:
        manifest = {"fingerprint": expected, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = current / f".{MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(current / MANIFEST)  # atomic: a reader never sees half a manifest
    return current, set_aside


def enable_persistent_caches(cache_dir=None) -> PersistentCaches:
    """Use the cache folder ``cache_dir`` (default `default_cache_dir`) for Triton's and Inductor's caches in this
    process: checks its manifest (a stale or corrupt folder is set aside and rebuilt), sets ``TRITON_CACHE_DIR``,
    ``TRITON_CACHE_AUTOTUNING=1`` and ``TORCHINDUCTOR_CACHE_DIR`` where the user has not, and, where the user's own
    directories keep those caches elsewhere (`artifacts_needed`), loads torch's compile artifacts saved by an earlier
    process (a file that fails to load is set aside). Once per folder per process."""
    root = Path(default_cache_dir() if cache_dir is None else cache_dir).expanduser().resolve()
    with _LOCK:
        done = _ENABLED.get(str(root))
        if done is not None:
            return done
        current, set_aside = prepare(root)
        caches = PersistentCaches(root, current, set_aside)
        for name, sub in ENV_DIRS.items():
            value = str(current / sub)
            if os.environ.get(name):
                caches.user_env[name] = os.environ[name]
            else:
                os.environ[name] = value
                caches.env[name] = value
        for name, value in ENV_FLAGS.items():
            if name in os.environ:
                caches.user_env[name] = os.environ[name]
            else:
                os.environ[name] = value
                caches.env[name] = value
        caches.loaded_artifacts = artifacts_needed(caches) and _load_artifacts(root, current)
        _ENABLED[str(root)] = caches
        return caches


def artifacts_needed(caches: PersistentCaches) -> bool:
    """Whether torch's compile-artifacts file is worth saving and loading for ``caches``: only when the user's own
    ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` keeps those caches outside the folder. Otherwise every entry
    the file holds (FX graphs, AOTAutograd results, kernels, autotuning, Dynamo's automatic-dynamic profiles) is
    already in ``current/``, written there by the process that compiled it, where torch looks first;
    `torch.compiler.load_cache_artifacts` would only write each one again (4.0-5.8 s of a second Qwen3-VL-8B process's
    start in the twenty-second session's cold-start run)."""
    return any(name in caches.user_env and _resolved(caches.user_env[name]) != _resolved(caches.entries / sub)
               for name, sub in ENV_DIRS.items())


def _resolved(path) -> Path:
    return Path(path).expanduser().resolve()


def _load_artifacts(root: Path, current: Path) -> bool:
    """Load torch's compile artifacts an earlier process saved; a file torch cannot read (it checks a checksum and
    answers None) is set aside with a warning, never half trusted."""
    path = current / ARTIFACTS
    if not path.exists():
        return False
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
        error = None if info is not None else "unreadable (a checksum or format mismatch)"
    except Exception as raised:  # noqa: BLE001 (whatever torch raises on a foreign file: it is not used)
        info, error = None, f"{type(raised).__name__}: {raised}"
    if error is None:
        return True
    stale = root / "stale"
    stale.mkdir(parents=True, exist_ok=True)
    target = stale / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{ARTIFACTS}"
    path.rename(target)
    import warnings

    warnings.warn(f"raincheck cache: {path} could not be loaded ({error}); set aside as {target}, rebuilt by this "
                  "process's compiles", RuntimeWarning, stacklevel=3)
    return False


def save_compile_artifacts(cache_dir=None) -> Path | None:
    """Write torch's compile artifacts of this process (`torch.compiler.save_cache_artifacts`) into the cache
    folder, for the next process to load; the path, or None when there was nothing to save or no need to
    (`artifacts_needed`: the folder holds the caches themselves)."""
    import torch

    root = Path(default_cache_dir() if cache_dir is None else cache_dir).expanduser().resolve()
    caches = _ENABLED.get(str(root))
    if caches is None or not artifacts_needed(caches):
        return None
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    data, _ = saved
    if not data:
        return None
    path = caches.entries / ARTIFACTS
    tmp = path.with_name(f".{ARTIFACTS}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def info(cache_dir=None) -> dict:
    """The folder, its manifest, whether it matches this process (`check`), and sizes (bytes) of what it holds."""
    root = Path(default_cache_dir() if cache_dir is None else cache_dir).expanduser()
    current = root / "current"
    out = {"folder": str(root), "exists": root.exists(), "manifest": None, "matches": None, "sizes": {}}
    if current.exists():
        data = _read_manifest(current)
        out["manifest"] = data
        reason = check(current, fingerprint())
        out["matches"] = reason is None
        out["mismatch"] = reason
        out["sizes"] = {p.name: _size(p) for p in sorted(current.iterdir())}
    stale = root / "stale"
    if stale.exists():
        out["stale"] = {p.name: _size(p) for p in sorted(stale.iterdir())}
    return out


def clear(cache_dir=None) -> int:
    """Delete the cache folder's entries (``current/`` and ``stale/``); returns the bytes freed. Anything else in
    the folder is left alone."""
    root = Path(default_cache_dir() if cache_dir is None else cache_dir).expanduser()
    freed = 0
    for name in ("current", "stale"):
        path = root / name
        if path.exists():
            freed += _size(path)
            shutil.rmtree(path)
    with _LOCK:
        _ENABLED.pop(str(root.resolve()), None)
    return freed
