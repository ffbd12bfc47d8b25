#!/bin/sh
# Slow-consumer memory benchmark (not part of `cargo test`): builds mercuriod and the
# slow_consumer example in release mode, then runs mercuriod with max_queued_bytes set,
# floods a subscriber that never reads for 30 s and prints the broker's VmRSS every second.
#
#   benches/slow_consumer.sh [--seconds N] [--max-queued-bytes N] [--payload N]
#
# CARGO_TARGET_DIR is honoured. Linux only (reads /proc/PID/status).
set -eu
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
cargo build --release -p mercuriod
cargo build --release --example slow_consumer
exec "$target/release/examples/slow_consumer" --mercuriod "$target/release/mercuriod" "$@"
