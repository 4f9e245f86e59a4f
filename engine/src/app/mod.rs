//! Start-up and command-line glue: configuration, `flashsale serve` (which starts the durable
//! side and the shards), host checks, the admin CLI, PostgreSQL backups and restore drills, and
//! the private server stack. The top layer: it may import every other folder, and nothing
//! imports it.

pub mod admin_cli;
pub mod backup;
pub mod chaos;
pub mod config;
pub mod cpu;
pub mod demo;
pub mod demo_cpu;
pub mod payments_cli;
pub mod serve;
pub mod stack;
pub mod startup;
