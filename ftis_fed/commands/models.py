"""``ftis-fed models fetch``: download a hub model into the local Hugging Face cache BEFORE a run;
``ftis-fed models build``: build the run's offline models into the ftis-fed cache before a run.

A participant given a hub id loads it with ``from_pretrained`` during ``hello``, inside the run's
participant wait: a multi-GB first download there gets the participant dropped. So runs refuse a hub
id that is not cached (``ftis_fed.config.models_check.check_model``), and this command is the step before the
run (simulation and deployment alike): it downloads with progress (huggingface_hub's bars on
stderr) into the cache the participants read, or fails with one clear line.

Revision and token: ``--revision`` (branch, tag or commit; default the repo's default branch) and
``--token`` or the usual ``HF_TOKEN`` environment variable (gated / private models); ``HF_HOME`` /
``HF_HUB_CACHE`` choose the cache, ``HF_ENDPOINT`` a mirror. The command prints the snapshot folder:
give that folder as the participant's ``model`` to pin exactly this revision (a hub id loads the
cached default branch).

Offline models (``smollm2``, ``tiny-arith``, ...) are built on first use into ``~/.cache/ftis-fed``
(a GGUF conversion, SFT steps: minutes on a CPU). ``ftis-fed sim`` builds the ones its run needs
before Flower starts, saying "building …" with the time every 15 s, and checks each (config and
tokenizer load); under a plain ``flwr run`` the ServerApp names this command
(``ftis-fed models build --preset NAME`` or ``ftis-fed models build MODEL ...``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

#: the files a causal LM needs (weights, config, tokenizer, chat template); ``--all-files`` fetches all
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


class HubFetchError(RuntimeError):
    """A model could not be fetched (offline and not cached, unknown repo, no access, network)."""


def _is_hub_id(value: str) -> bool:
    from ftis_fed.config.models_check import _HUB_ID

    return bool(_HUB_ID.match(value)) and not value.startswith(".") and not Path(value).expanduser().exists()


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (with its config.json), or None.
    Reads the cache only: never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    return path if (path / "config.json").exists() else None


def fetch_model(repo_id: str, revision: str | None = None, token: str | None = None,
                cache_dir: str | None = None, all_files: bool = False) -> tuple[Path, bool]:
    """(snapshot folder, was it already cached). Downloads what is missing, with progress bars;
    raises HubFetchError with one line naming the model and what to do."""
    if not _is_hub_id(repo_id):
        raise HubFetchError(f"models fetch {repo_id!r}: not a hub id (expected <org>/<name>; a local folder or "
                            "an offline model needs no fetch)")
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    hit = cached_snapshot(repo_id, revision, cache_dir)
    if hit is not None:
        return hit, True
    from huggingface_hub import constants, snapshot_download

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise HubFetchError(f"models fetch {where}: not in the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE}) "
                            "and HF_HUB_OFFLINE is set: unset it on a machine that reaches the hub, or copy the "
                            "model folder here and give the folder as the participant's model")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, token=token or None, cache_dir=cache_dir,
                                      allow_patterns=None if all_files else list(MODEL_FILES)))
    except Exception as e:                                    # noqa: BLE001 - reported as one line
        raise HubFetchError(f"models fetch {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                            "(check the id, the revision, HF_TOKEN for gated models, and the network)") from e
    if not (path / "config.json").exists():
        raise HubFetchError(f"models fetch {where}: downloaded to {path}, but it has no config.json "
                            "(not a transformers model repo?)")
    return path, False


def add_cli(sub) -> None:
    p = sub.add_parser("models", help="models: fetch a hub model / build offline models into the cache before a run")
    m = p.add_subparsers(dest="models", required=True)
    f = m.add_parser("fetch", help="download a hub model (with progress) into the Hugging Face cache; "
                                   "prints one JSON line with the snapshot folder")
    f.add_argument("model", help="hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    f.add_argument("--revision", default=None, help="branch, tag or commit (default: the default branch)")
    f.add_argument("--token", default=None, help="hub token (default: $HF_TOKEN / the saved login)")
    f.add_argument("--cache-dir", default=None, help="cache folder (default: $HF_HUB_CACHE)")
    f.add_argument("--all-files", action="store_true", help=f"every file of the repo, not only {', '.join(MODEL_FILES)}")

    def run(a) -> int:
        try:
            path, cached = fetch_model(a.model, a.revision, a.token or os.environ.get("HF_TOKEN"), a.cache_dir,
                                       a.all_files)
        except HubFetchError as e:
            print(f"ftis-fed: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"model": a.model, "revision": a.revision, "path": str(path), "cached": cached}))
        return 0

    f.set_defaults(func=run)

    b = m.add_parser("build", help="build the offline models a run needs (or the named ones) into the cache, "
                                   "before a run; prints one JSON line with their folders")
    b.add_argument("model", nargs="*", help="offline model names (default: those of the run config)")
    b.add_argument("--app", default=".", help="the Flower app folder (default: .)")
    b.add_argument("--preset", default=None, help="a run-config preset, as for ftis-fed sim")
    b.add_argument("--run-config", action="append", default=[], help="overrides, as for ftis-fed sim")

    def build(a) -> int:
        from ftis_fed.commands.sim import build_models
        from ftis_fed.config.validation import models_to_build
        from ftis_fed.config.models_check import offline_model_names
        from ftis_fed.policies.store import is_built

        try:
            if a.model:
                unknown = [x for x in a.model if x not in offline_model_names() and not Path(x).expanduser().is_dir()]
                if unknown:
                    raise ValueError(f"{unknown[0]!r}: not an offline model ({', '.join(offline_model_names())})")
                todo = {x: ["the command line"] for x in a.model if x in offline_model_names() and not is_built(x)}
            else:
                from ftis_fed.commands.sim import checked_run_config, layered_overrides, merged_run_config

                app = Path(a.app).resolve()
                overrides, _, _ = checked_run_config(app, layered_overrides(app, a.run_config, a.preset))
                todo = models_to_build(merged_run_config(app, overrides))
            built = build_models(todo, say=lambda line: print(line, file=sys.stderr, flush=True))
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            print(f"ftis-fed models build: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"built": built}))
        return 0

    b.set_defaults(func=build)
