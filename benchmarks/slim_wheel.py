"""Slim a transformers wheel for the GPU machine's 64 MiB carry: keep only the model folders the package needs.

    python benchmarks/slim_wheel.py .whl/transformers-5.24.0-py3-none-any.whl

The wheel is rewritten in place (the original kept as ``<name>.full``): every file outside ``transformers/models/``
stays; of the model folders, the families `raincheck_hf` supports, ``auto``, and every folder their Python files
import (``from ..<folder>``), transitively. RECORD loses the dropped files' lines. The code kept is byte for byte
the wheel's; transformers resolves models lazily by name, so a folder never imported is never read.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import sys
import zipfile

SEEDS = ("auto", "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def folders_needed(wheel: zipfile.ZipFile, seeds=SEEDS) -> set[str]:
    by_folder = collections.defaultdict(list)
    for name in wheel.namelist():
        parts = name.split("/")
        if len(parts) > 3 and parts[:2] == ["transformers", "models"]:
            by_folder[parts[2]].append(name)
    need, todo = set(), list(seeds)
    while todo:
        folder = todo.pop()
        if folder in need:
            continue
        need.add(folder)
        for name in by_folder.get(folder, ()):
            if name.endswith(".py"):
                text = wheel.read(name).decode("utf-8", "ignore")
                todo += [dep for dep in re.findall(r"from \.\.(\w+)", text) if dep in by_folder]
    return need


def slim(path: str) -> tuple[int, int, int]:
    full = path + ".full"
    if not os.path.exists(full):
        shutil.copyfile(path, full)
    with zipfile.ZipFile(full) as wheel:
        need = folders_needed(wheel)

        def keep(name: str) -> bool:
            parts = name.split("/")
            return not (len(parts) > 3 and parts[:2] == ["transformers", "models"]) or parts[2] in need

        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for info in wheel.infolist():
                if not keep(info.filename):
                    continue
                data = wheel.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = "".join(line + "\n" for line in data.decode().splitlines() if keep(line.split(",")[0]))
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return len(need), os.path.getsize(full), os.path.getsize(path)


if __name__ == "__main__":
    for wheel_path in sys.argv[1:]:
        folders, before, after = slim(wheel_path)
        print(f"{wheel_path}: {folders} model folders kept, {before:,} -> {after:,} bytes")
