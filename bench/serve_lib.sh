# Sourced by the serving benchmarks: start `instgenie serve` with the flags in the array `serve`
# (and $SERVE_ARGS), its log in $OUT/server.log, stopped when the script exits; return once /ready
# answers on $PORT (a server that died is reported at once, with its log); the seconds from start
# to ready in $OUT/ready_s. Needs $py, $OUT, $PORT.
start_server() {
  # shellcheck disable=SC2206 # SERVE_ARGS is a list of extra `serve` flags
  [ -n "${SERVE_ARGS:-}" ] && serve+=($SERVE_ARGS)
  local t0; t0=$(date +%s)
  $py -m instgenie.server serve "${serve[@]}" > "$OUT/server.log" 2>&1 &
  server=$!
  trap 'kill -TERM "$server" 2>/dev/null || true; wait "$server" || true' EXIT
  for _ in $(seq 900); do
    kill -0 "$server" 2>/dev/null || { echo "server exited:"; tail -20 "$OUT/server.log"; exit 1; }
    $py -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/ready', timeout=2)" \
        2>/dev/null && { echo $(($(date +%s) - t0)) > "$OUT/ready_s"; return 0; }
    sleep 1
  done
  echo "server not ready after 900 s"; exit 1
}
