# Local ports for the cluster benchmarks (sourced by cluster_connect.sh and cluster_crash.sh).
#
#   free_port       print a TCP port free on 127.0.0.1 now
#   wait_port PORT  wait (10 s at most) until something listens on PORT, else exit 1

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
    for _ in $(seq 100); do
        python3 -c "import socket,sys; socket.create_connection(('127.0.0.1',$1)).close()" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "port $1 not listening" >&2; exit 1
}
