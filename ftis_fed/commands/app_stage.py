"""The app folder ``flwr run`` reads, without the folders the app's ``.gitignore`` leaves out.

``flwr run APP`` builds its app bundle (FAB) by walking every file under APP
(``flwr.cli.utils.collect_files``: an ``os.walk`` and a ``resolve()`` per file) and only afterwards
drops what ``.gitignore`` and Flower's FAB rules exclude. With the project's virtual environment
inside APP (``.venv``, 2.2 GB) that walk alone cost ~4 s of CPU on every run. ``ftis-fed sim``
therefore walks APP once, not descending into a folder that ``.gitignore`` ignores (git does not
look inside one either, so no negated pattern can bring a file of it back) or that Flower's publish
rules exclude whole (``.venv/**``, ``.flwr/**``, ``**/__pycache__/**``); it links
(or copies) the remaining files into a staging folder and hands ``flwr run`` that folder. Flower's own
rules then see the same candidate files and build the same FAB, byte for byte
(``tests/test_app_stage.py``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from flwr.cli.utils import build_pathspec, load_gitignore_patterns
from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS


def stage_app(app: Path, into: Path) -> Path:
    """Link every file of ``app`` that ``flwr run`` could put in its FAB into ``into`` (created; the
    same relative paths; a copy where a link cannot be made, e.g. across file systems) and return
    ``into``. Symlinks are left out, as Flower leaves them out."""
    app = app.resolve()
    ignored = build_pathspec(load_gitignore_patterns(app / ".gitignore"))
    whole = build_pathspec(APP_PUBLISH_EXCLUDE_PATTERNS)
    into.mkdir(parents=True, exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(app, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(app).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames
                       if not ignored.match_file(f"{prefix}{d}/")
                       and not whole.match_file(f"{prefix}{d}/-")]
        for name in filenames:
            src = here / name
            if src.is_symlink():
                continue
            dst = into / prefix / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    return into
