"""The ServerApp: read the run config, prepare keys and the output folder, run the round engine
(``ftis_fed.engine``) over Flower's Grid (``strategies.grid_transport``)."""

from __future__ import annotations

from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from ftis_fed.config.participants import participant_names, participant_spec
from ftis_fed.config.validation import models_to_build, validate_run_config
from ftis_fed.engine.core import Engine
from ftis_fed.trust.signing import generate_keypair, key_paths, load_key_directory

from strategies.churn import ChurnTransport
from strategies.grid_transport import GridTransport, supernode_key_names

app = ServerApp()


def prepare_keys(keys_dir: str, output_dir: Path, names: list[str]) -> Path:
    """The run's key folder. '' (simulation): a key pair per participant in output_dir/keys,
    kept on resume. Otherwise the configured folder, which must hold ``public/``."""
    if keys_dir:
        return Path(keys_dir)
    path = output_dir / "keys"
    for name in names:
        if not key_paths(name, path).private.exists():
            generate_keypair(name, path)
    return path


def build_before_hello(run_config: dict, log=log) -> None:
    """Simulation under plain ``flwr run``: the offline models the participants use and the cache
    lacks are built here, before the first hello, so no participant builds one (minutes on a CPU)
    inside the hello wait (``wait-for-participants-s``), which would drop it and end the run. Says
    which, with the time every 15 s, and names the command that builds them before a run. A failed
    build ends the run (RuntimeError naming the model)."""
    from ftis_fed.commands.sim import build_models

    todo = models_to_build(run_config)
    for model, users in todo.items():
        log(WARNING, "ftis-fed: model %s (for %s) is not built yet: building it now, before the participants are "
            "asked (minutes on a CPU); `ftis-fed models build %s` builds it before a run (`ftis-fed sim` does that "
            "itself)", model, ", ".join(users), model)
    if todo:
        build_models(todo, say=lambda line: log(INFO, "%s", line))


@app.main()
def main(grid: Grid, context: Context) -> None:
    """In a simulation (nodes report the simulation's SuperNode count at hello), fewer SuperNodes
    than the run config's declared participants stop the run with the fixing command
    (``TooFewSupernodes``: the run ends as failed); in deployment only min-participants applies."""
    run_config = dict(context.run_config)
    fed = validate_run_config(run_config)           # the whole config, participants' models included, first
    out = Path(fed.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    declared = participant_names(run_config)
    keys = prepare_keys(fed.keys_dir, out, declared)
    log(INFO, "ftis-fed: output folder %s, keys %s", out, keys)
    if not fed.keys_dir:                            # simulation: the participants' models, on this machine
        build_before_hello(run_config, log)
    transport = GridTransport(grid, supernode_keys=supernode_key_names(keys))     # names nodes in wait lines
    schedules = {} if fed.keys_dir else churn_schedules(run_config, fed)    # simulated churn: simulation only
    if schedules:                                   # (a deployment node's participant_spec refuses it)
        transport = ChurnTransport(transport, schedules, fed.wait_for_participants_s, log)
    Engine(fed, load_key_directory(keys / "public"), out, transport, declared=declared, log=log).run()


def churn_schedules(run_config: dict, fed) -> dict:
    """participant -> its churn schedule, for the simulated participants that have one."""
    names = participant_names(run_config)
    out = {}
    for i, name in enumerate(names):
        spec = participant_spec(run_config, {"partition-id": i, "num-partitions": len(names)}, fed)
        if spec.churn:
            out[spec.name] = spec.schedule
    return out
