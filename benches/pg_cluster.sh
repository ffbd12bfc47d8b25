# A throwaway PostgreSQL server for the benchmarks (sourced by persistence.sh and failover.sh),
# as mercurio-storage/src/postgres/testing.rs does for the tests: MERCURIO_TEST_POSTGRES_URL
# when set, else a cluster started with initdb + pg_ctl (on PATH, in /usr/local, or Debian's
# newest /usr/lib/postgresql/NN/bin) on a private port and socket directory under a directory
# of the caller, run as the postgres user when root. Unlike the tests' cluster it keeps
# fsync on, so that commits cost what they cost in production.
#
#   pg_start DIR         start (DIR must exist; it is removed by the caller); sets PG_BASE.
#                        PG_PIN: a command prefix for the server, e.g. "taskset -c 0"
#   pg_database NAME     create database NAME, print its URL
#   pg_sql URL SQL       run SQL, print the rows unaligned
#   pg_stop              stop the cluster, or drop the databases created on an external server

PG_BASE=
PG_QUERY=
PG_DATA=
PG_CTL=
PG_AS=()
PG_CREATED=  # a file: the databases created, one a line (also from subshells)

pg_find_binaries() {
  local d
  local dirs
  IFS=: read -r -a dirs <<< "${PATH:-}"
  dirs+=(/usr/local/bin /usr/local/pgsql/bin)
  while read -r d; do dirs+=("$d"); done < <(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k4 -n -r)
  for d in "${dirs[@]}"; do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
      echo "$d"; return 0
    fi
  done
  return 1
}

pg_start() {
  local dir=$1
  PG_CREATED=$dir/created
  : > "$PG_CREATED"
  command -v psql >/dev/null || { echo "psql not found (install postgresql-client)" >&2; return 1; }
  if [ -n "${MERCURIO_TEST_POSTGRES_URL:-}" ]; then
    # postgres://user:password@host:port[/db][?query]: keep the server, replace the database.
    local url=$MERCURIO_TEST_POSTGRES_URL rest
    rest=${url#*://}
    PG_BASE="${url%%://*}://${rest%%/*}"
    PG_BASE=${PG_BASE%%\?*}
    case $rest in *\?*) PG_QUERY="?${rest#*\?}" ;; esac
    return 0
  fi
  local bin
  bin=$(pg_find_binaries) || { echo "no MERCURIO_TEST_POSTGRES_URL and no initdb/pg_ctl" >&2; return 1; }
  PG_CTL=$bin/pg_ctl
  PG_DATA=$dir/data
  if [ "$(id -u)" = 0 ]; then
    id -u postgres >/dev/null 2>&1 || useradd --system --user-group --no-create-home postgres
    PG_AS=(runuser -u postgres --)
    chown postgres: "$dir"
    # The server must reach its directory through the caller's private temporary directory.
    chmod o+x "$(dirname "$dir")"
  fi
  LC_ALL=C "${PG_AS[@]}" "$bin/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 \
    --no-sync > "$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; return 1; }
  local port _
  for _ in 1 2 3; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2086 # PG_PIN is a command prefix
    if ${PG_PIN:-} "${PG_AS[@]}" "$PG_CTL" -D "$PG_DATA" -l "$dir/log" -w -t 60 \
      -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=200" \
      start > /dev/null; then
      PG_BASE="postgres://postgres@127.0.0.1:$port"
      return 0
    fi
  done
  cat "$dir/log" >&2
  PG_DATA=
  return 1
}

pg_sql() { # url, sql
  psql -X -q -A -t -v ON_ERROR_STOP=1 -d "$1" -c "$2"
}

pg_database() { # name
  pg_sql "$PG_BASE/postgres$PG_QUERY" "CREATE DATABASE $1" >&2 || return 1
  echo "$1" >> "$PG_CREATED"
  echo "$PG_BASE/$1$PG_QUERY"
}

pg_stop() {
  if [ -n "$PG_DATA" ]; then
    "${PG_AS[@]}" "$PG_CTL" -D "$PG_DATA" -m immediate -w stop > /dev/null 2>&1 || true
    PG_DATA=
  elif [ -n "$PG_BASE" ]; then
    local db
    while read -r db; do
      pg_sql "$PG_BASE/postgres$PG_QUERY" "DROP DATABASE IF EXISTS $db WITH (FORCE)" \
        > /dev/null 2>&1 || true
    done < "$PG_CREATED"
    PG_BASE=
  fi
}
