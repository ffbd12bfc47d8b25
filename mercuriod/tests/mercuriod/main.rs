//! mercuriod run as a process (configuration, signals, admin socket, restarts, interoperability):
//! one test binary, one module per concern, every daemon started through mercurio-testkit.

mod admin_api;
mod bridge;
mod bridge_reload;
mod cli;
mod cluster;
mod cluster_chaos;
mod cluster_qos;
mod cluster_sessions;
mod cluster_stall;
mod console;
mod credentials;
mod daemon;
mod dashboards;
mod example_config;
mod interop_mosquitto;
mod interop_paho;
mod ops;
mod packaging;
mod persistence;
mod proxy_protocol;
mod run;
mod security_reload;
mod standby;
mod threads;
