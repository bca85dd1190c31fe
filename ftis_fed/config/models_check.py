"""Does a participant's ``model`` resolve without a hub? A registered offline name, a local model folder,
or a hub id already in the local Hugging Face cache (probed, nothing downloaded or loaded)."""

from __future__ import annotations

import os
import re
from pathlib import Path


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def offline_model_names() -> list[str]:
    """The registered offline models (``policies.models.OFFLINE_MODELS``, derived ones included)."""
    from ftis_fed.policies import models            # importing it registers the derived and sized builders

    return sorted(models.OFFLINE_MODELS)


def check_model(value: str, key: str = "model", participant: str = "") -> None:
    """Cheap check that a participant's ``model`` resolves without a hub: a registered offline name,
    an existing local model folder, or a hub id already in the local Hugging Face cache. Nothing is
    built or loaded. Raises ValueError, one line naming the key (e.g. ``p3-model``), the value, the
    participant and the offline names."""
    names = offline_model_names()
    if value in names:
        return
    offline = f"offline models: {', '.join(names)}"
    who = f"{key}={value!r}" + (f" (participant {participant})" if participant else "")
    path = Path(value).expanduser()
    if path.is_dir():
        if (path / "config.json").exists() or (path / "adapter_config.json").exists():
            return
        raise ValueError(f"{who}: the folder has no config.json (not a model folder); {offline}")
    if path.exists():
        raise ValueError(f"{who}: not a model folder (a file); {offline}")
    if _HUB_ID.match(value) and not value.startswith("."):
        if _in_hub_cache(value):
            return
        offline_mode = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        why = "HF_HUB_OFFLINE is set" if offline_mode else "this run checks models before it starts, offline"
        raise ValueError(f"{who}: a hub id that is not in the local Hugging Face cache ({why}): "
                         f"download it first (ftis-fed models fetch {value}) or give a local folder; {offline}")
    if "/" in value or value.startswith(("~", ".")):
        raise ValueError(f"{who}: no such model folder; {offline}")
    raise ValueError(f"{who}: unknown model (not an offline model, a local folder or a hub id); {offline}")


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        got = try_to_load_from_cache(repo_id, "config.json")
    except Exception:                                    # malformed id, unreadable cache: not there
        return False
    return isinstance(got, str)
