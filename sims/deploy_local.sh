#!/usr/bin/env bash
# A real deployment on one machine, over TLS: one SuperLink, one SuperNode per participant (each with
# its own FLWR_HOME, its own private key, its model chosen by --node-config), and `flwr run` against
# the `local-deploy` connection of flower.toml. Prints the run's status and per-round lines.
#
#   sims/deploy_local.sh [workdir] [participants] [rounds]
#     workdir       default: a new temporary folder
#     participants  default 2 (alice, bob, carol, ...); models cycle tiny-arith / tiny-llama-b
#     rounds        default 2
#   MODEL_A / MODEL_B override the two models (e.g. MODEL_A=smollm2 MODEL_B=smollm2-bpe8k).
set -euo pipefail
APP="$(cd "$(dirname "$0")/.." && pwd)"
B="${1:-$(mktemp -d /tmp/ftis-deploy.XXXXXX)}"
N="${2:-2}"
ROUNDS="${3:-2}"
MODEL_A="${MODEL_A:-tiny-arith}"
MODEL_B="${MODEL_B:-tiny-llama-b}"
PY="$APP/.venv/bin"
export PATH="$PY:$PATH" FLWR_DISABLE_UPDATE_CHECK=1
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
mkdir -p "$B"
echo "[deploy] workdir $B, SuperLink 127.0.0.1:$PORT (TLS), $N participants, $ROUNDS rounds"

# --- TLS: a CA and a certificate for 127.0.0.1 -------------------------------------------------
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=ftis-fed test CA" \
  -keyout "$B/ca.key" -out "$B/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$B/server.key" -out "$B/server.csr" 2>/dev/null
printf "subjectAltName=IP:127.0.0.1,DNS:localhost\n" > "$B/san.ext"
openssl x509 -req -in "$B/server.csr" -CA "$B/ca.crt" -CAkey "$B/ca.key" -CAcreateserial -days 2 \
  -extfile "$B/san.ext" -out "$B/server.crt" 2>/dev/null

# --- keys: every organisation makes its own; the public halves are shared ----------------------
names=(alice bob carol dave erin frank)
mkdir -p "$B/public"
for ((i = 0; i < N; i++)); do
  n=${names[$i]}
  ftis-fed keys generate "$n" --dir "$B/$n/keys" >/dev/null
  cp "$B/$n/keys/public/$n.pub" "$B/public/"
done
for ((i = 0; i < N; i++)); do n=${names[$i]}; cp "$B"/public/*.pub "$B/$n/keys/public/"; done
mkdir -p "$B/server-keys/public" && cp "$B"/public/*.pub "$B/server-keys/public/"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  pkill -f "clients.worker --spec $B" 2>/dev/null || true
  FTIS_FED_RUNTIME="$B/rt" pkill -f "$B/rt" 2>/dev/null || true
}
trap cleanup EXIT

# --- the SuperLink (the coordinating organisation) ---------------------------------------------
mkdir -p "$B/link"
(cd "$B/link" && FLWR_HOME="$B/link" FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 exec flower-superlink \
  --ssl-ca-certfile "$B/ca.crt" --ssl-certfile "$B/server.crt" --ssl-keyfile "$B/server.key" \
  --host 127.0.0.1 --port "$PORT" >"$B/link/superlink.log" 2>&1) &
pids+=($!)
sleep 5

# --- one SuperNode per participant -------------------------------------------------------------
for ((i = 0; i < N; i++)); do
  n=${names[$i]}
  model=$([ $((i % 2)) -eq 0 ] && echo "$MODEL_A" || echo "$MODEL_B")
  (cd "$B/$n" && FLWR_HOME="$B/$n" FTIS_FED_RUNTIME="$B/rt" exec flower-supernode \
    --root-certificates "$B/ca.crt" --superlink "127.0.0.1:$PORT" --port $((PORT + 1 + i)) \
    --node-config "participant=\"$n\" model=\"$model\" keys-dir=\"$B/$n/keys\" state-dir=\"$B/$n/state\" partition-id=$i num-partitions=$N" \
    >"$B/$n/supernode.log" 2>&1) &
  pids+=($!)
done

# --- flwr run against flower.toml's local-deploy connection (address and CA filled in) ----------
mkdir -p "$B/cli"
python3 - "$APP/flower.toml" "$B/cli/config.toml" "$PORT" "$B/ca.crt" <<'EOF'
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
EOF
export FLWR_HOME="$B/cli"
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
