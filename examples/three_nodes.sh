#!/usr/bin/env bash
# Three separate `gpumesh node` processes on one machine, each with its own data dir
# and ports: the multi-machine recipe, on loopback. Node a forms the mesh (and makes
# its cluster key), b and c join with a's ticket. Submits a sharded task through one
# node, fetches the result through another, shows the mesh; then kills a (the node
# everyone joined through) with SIGKILL and submits again, giving the client a then b.
#
#   bash examples/three_nodes.sh        (builds gpumesh in release mode first)
#
# Ports 27001-27003 (peers) and 27101-27103 (APIs): below Linux's ephemeral range
# (32768 on), so no outgoing connection is handed one of them before a node binds it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/gpumesh
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP:-}" ] && cp -r "$work" /tmp/three_nodes_debug
  rm -rf "$work"
}
trap cleanup EXIT
export RUST_LOG=${RUST_LOG:-warn,wgpu_hal=error,wgpu_core=error,naga=error}

start() { # name listen-port api-port extra-args...
  local name=$1 port=$2 api=$3; shift 3
  "$bin" node --data-dir "$work/$name" --listen "/ip4/127.0.0.1/tcp/$port" \
    --api "127.0.0.1:$api" --no-mdns "$@" > "$work/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do
    grep -q "API on" "$work/$name.log" 2>/dev/null && break
    sleep 0.2
  done
  grep -q "API on" "$work/$name.log" || { cat "$work/$name.log"; exit 1; }
}

start a 27001 27101 --init
ticket=$("$bin" ticket --data-dir "$work/a" | tail -n 1)
start b 27002 27102 --join "$ticket"
start c 27003 27103 --join "$ticket"
echo "three nodes up; b and c joined with a's ticket ${ticket:0:24}…"

GPUMESH_API=127.0.0.1:27102 "$bin" submit --builtin matmul --size 512 --shards 6 --wait --verify
task=$(GPUMESH_API=127.0.0.1:27101 "$bin" tasks --json | grep -o '"id": *[0-9]*' | tail -1 | grep -o '[0-9]*$')
GPUMESH_API=127.0.0.1:27103 "$bin" result "t$task" --out-dir "$work/out"
GPUMESH_API=127.0.0.1:27101 "$bin" status
GPUMESH_API=127.0.0.1:27101 "$bin" tasks

echo "kill -9 of node a, the one b and c joined through"
kill -9 "${pids[0]}"
# A client given several nodes goes on at the next when one does not answer: a is
# first in the list, and dead.
GPUMESH_API=127.0.0.1:27101,127.0.0.1:27102 "$bin" submit --builtin matmul --size 256 --shards 4 --wait --verify
GPUMESH_API=127.0.0.1:27103 "$bin" status
