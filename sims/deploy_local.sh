#!/usr/bin/env bash
# A real deployment on one machine, over TLS with Flower's SuperNode authentication: one SuperLink
# (--enable-supernode-auth), one SuperNode per participant (each with its own FLWR_HOME, its own
# Ed25519 signing key and SuperNode key from `ftis-fed keys generate`, registered with
# `flwr supernode register`, its model chosen by --node-config), and `flwr run` against the
# `local-deploy` connection of flower.toml. Prints the run's status and per-round lines.
#
#   sims/deploy_local.sh [workdir] [participants] [rounds]
#     workdir       default: a new temporary folder
#     participants  default 2 (alice, bob, carol, ...); models cycle tiny-arith / tiny-llama-b
#     rounds        default 2
#   MODEL_A / MODEL_B override the two models (e.g. MODEL_A=smollm2 MODEL_B=smollm2-bpe8k).
#   SUPERNODE_AUTH=0 runs TLS without SuperNode authentication (any SuperNode may connect).
#   REVOKE=<name> writes <name>'s key fingerprint to every revoked.txt before the run (its batches
#   are then rejected with reason revoked_key, by the server and by every receiver).
set -euo pipefail
APP="$(cd "$(dirname "$0")/.." && pwd)"
B="${1:-$(mktemp -d /tmp/ftis-deploy.XXXXXX)}"
N="${2:-2}"
ROUNDS="${3:-2}"
MODEL_A="${MODEL_A:-tiny-arith}"
MODEL_B="${MODEL_B:-tiny-llama-b}"
SUPERNODE_AUTH="${SUPERNODE_AUTH:-1}"
PY="$APP/.venv/bin"
mkdir -p "$B"
B="$(cd "$B" && pwd)"
export PATH="$PY:$PATH" FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FTIS_DEPLOY_LOCAL="$B"             # marks every process started here (cleanup finds them by it)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
echo "[deploy] workdir $B, SuperLink 127.0.0.1:$PORT (TLS, SuperNode auth $([ "$SUPERNODE_AUTH" = 1 ] && echo on || echo off)), $N participants, $ROUNDS rounds"
keys() { (cd "$APP" && python -m ftis_fed.commands.cli keys "$@"); }

# --- the models, built into the shared cache before anything waits on them -----------------------
# (the first use of tiny-arith trains it for a few minutes; a SuperNode building it would miss the
# server's hello deadline)
(cd "$APP" && python -m ftis_fed.commands.cli models build "$MODEL_A" "$MODEL_B" >/dev/null) || exit 1

# --- TLS: a private CA and the SuperLink's certificate for 127.0.0.1 ---------------------------
keys tls 127.0.0.1 localhost --dir "$B/certs" --days 2 >/dev/null

# --- flwr's connection (address and CA filled in): used to register SuperNodes and to run ------
mkdir -p "$B/cli"
python3 - "$APP/flower.toml" "$B/cli/config.toml" "$PORT" "$B/certs/ca.crt" <<'PYEOF'
import sys, tomllib
src, dst, port, ca = sys.argv[1:]
cfg = tomllib.loads(open(src).read())
conn = cfg["superlink"]["local-deploy"]
conn["address"] = f"127.0.0.1:{port}"
conn.pop("insecure", None)
conn["root-certificates"] = ca
lines = ['[superlink]', 'default = "local-deploy"', '', '[superlink.local-deploy]']
lines += [f'{k} = "{v}"' if isinstance(v, str) else f'{k} = {str(v).lower()}' for k, v in conn.items()]
open(dst, "w").write("\n".join(lines) + "\n")
PYEOF

# --- keys: every organisation makes its own two pairs; the public signing keys are shared -------
names=(alice bob carol dave erin frank)
mkdir -p "$B/public"
for ((i = 0; i < N; i++)); do
  n=${names[$i]}
  keys generate "$n" --dir "$B/$n/keys" --connection local-deploy --superlink "127.0.0.1:$PORT" \
    --root-certificates "$B/certs/ca.crt" >"$B/$n.keys.txt"
  cp "$B/$n/keys/public/$n.pub" "$B/public/"
done
for ((i = 0; i < N; i++)); do n=${names[$i]}; cp "$B"/public/*.pub "$B/$n/keys/public/"; done
mkdir -p "$B/server-keys/public" && cp "$B"/public/*.pub "$B/server-keys/public/"
if [ -n "${REVOKE:-}" ]; then
  for d in "$B/server-keys" "${names[@]/#/$B/}"; do
    [ -d "$d/public" ] && (cd "$APP" && python -m ftis_fed.commands.cli keys revoke "$REVOKE" --dir "$d" \
      --note "sims/deploy_local.sh REVOKE" >/dev/null)
  done
  echo "[deploy] revoked $REVOKE's key in every revoked.txt"
fi

pids=()
cleanup() {
  # the process groups started here, then anything else carrying this run's marker (the
  # participants' detached workers, app processes): by process id, nothing matched by name
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  for _ in $(seq 20); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    [ "$p" = "$$" ] && continue
    if { tr '\0' '\n' <"$e" | grep -qxF "FTIS_DEPLOY_LOCAL=$B"; } 2>/dev/null; then kill -KILL "$p" 2>/dev/null || true; fi
  done
}
trap cleanup EXIT

# --- the SuperLink (the coordinating organisation), its certificate checked before it starts ----
(cd "$APP" && python -m ftis_fed.commands.cli deploy cert 127.0.0.1 localhost \
  --ssl-certfile "$B/certs/server.crt" --ssl-ca-certfile "$B/certs/ca.crt") || exit 1
AUTH_FLAG=()
[ "$SUPERNODE_AUTH" = 1 ] && AUTH_FLAG=(--enable-supernode-auth)
mkdir -p "$B/link"
(cd "$B/link" && FLWR_HOME="$B/link" exec setsid flower-superlink \
  --ssl-ca-certfile "$B/certs/ca.crt" --ssl-certfile "$B/certs/server.crt" --ssl-keyfile "$B/certs/server.key" \
  "${AUTH_FLAG[@]}" --host 127.0.0.1 --port "$PORT" >"$B/link/superlink.log" 2>&1) &
pids+=($!)
for _ in $(seq 240); do grep -q "Uvicorn running on https" "$B/link/superlink.log" 2>/dev/null && break; sleep 0.5; done

# --- the operator registers each organisation's SuperNode key (the command keys generate printed)
export FLWR_HOME="$B/cli"
if [ "$SUPERNODE_AUTH" = 1 ]; then
  for ((i = 0; i < N; i++)); do
    n=${names[$i]}
    out=$(flwr supernode register "$B/$n/keys/supernode/$n.pub" local-deploy --name "$n" 2>&1) || { echo "$out"; exit 1; }
    echo "[deploy] $n: $(grep -o 'SuperNode [0-9]* registered' <<<"$out")"
  done
fi

# --- one SuperNode per participant -------------------------------------------------------------
for ((i = 0; i < N; i++)); do
  n=${names[$i]}
  model=$([ $((i % 2)) -eq 0 ] && echo "$MODEL_A" || echo "$MODEL_B")
  AUTH_KEY=()
  [ "$SUPERNODE_AUTH" = 1 ] && AUTH_KEY=(--auth-supernode-private-key "$B/$n/keys/supernode/$n.key")
  # the organisation checks TLS (and its key registration) the way its SuperNode will, first
  (cd "$APP" && python -m ftis_fed.commands.cli deploy check --superlink "127.0.0.1:$PORT" \
    --root-certificates "$B/certs/ca.crt" "${AUTH_KEY[@]}" | sed "s/^/[deploy] $n: /") || exit 1
  (cd "$B/$n" && FLWR_HOME="$B/$n" FTIS_FED_RUNTIME="$B/rt" exec setsid flower-supernode \
    --root-certificates "$B/certs/ca.crt" --superlink "127.0.0.1:$PORT" --port $((PORT + 1 + i)) "${AUTH_KEY[@]}" \
    --node-config "participant=\"$n\" model=\"$model\" keys-dir=\"$B/$n/keys\" state-dir=\"$B/$n/state\" partition-id=$i num-partitions=$N" \
    >"$B/$n/supernode.log" 2>&1) &
  pids+=($!)
done

# --- flwr run against flower.toml's local-deploy connection (written above) ---------------------
t0=$(date +%s)
RID=$(flwr run "$APP" local-deploy --format json --run-config \
  "num-rounds=$ROUNDS min-participants=$N keys-dir=\"$B/server-keys\" output-dir=\"$B/out\" eval-every=0 group-size=4 prompts-per-round=3 max-new-tokens=8 task-families=\"add1\" lr=0.001" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["run-id"])')
echo "[deploy] run $RID submitted"
while :; do
  ST=$(flwr ls local-deploy --run-id "$RID" --format json | python3 -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')
  case $ST in finished*) break ;; esac
  sleep 3
done
echo "[deploy] run $RID: $ST after $(( $(date +%s) - t0 )) s"
flwr log "$RID" local-deploy --show 2>&1 | grep -E "round [0-9]+/|participant |reward|dropped" | cut -c1-200 || true
for ((i = 0; i < N; i++)); do
  n=${names[$i]}
  echo "[deploy] $n: $(grep -c '"run"' "$B/$n/state/model_loads.jsonl") model load(s); worker log tail:"
  tail -n 3 "$B/$n/state/worker.log" | sed 's/^/    /'
done
[ "$ST" = "finished:completed" ]
