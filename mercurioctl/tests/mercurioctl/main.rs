//! mercurioctl run as a process against a real mercuriod: one test binary, one module per command family.

mod access;
mod cli;
mod import_mosquitto;
mod storage_full;
