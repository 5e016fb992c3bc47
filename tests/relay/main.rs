//! Integration tests: the relay against the real PostgreSQL (database `test`)
//! and RabbitMQ on this machine. Each test has its own schema, table,
//! exchange and queue, so they run in parallel.

mod cli;
mod delivery;
mod deploy;
mod discovery;
mod docs;
mod drift;
mod endpoints;
mod failover;
mod faults;
mod flow;
mod http;
mod lifecycle;
mod memory;
mod order;
mod pgbouncer;
mod proxy;
mod refusals;
mod retention;
mod rooms;
mod rows;
mod settlement;
mod support;
mod tls;
mod tracing;
mod trigger;
mod twins;
mod twophase;
mod upgrade;
mod values;
mod wakeup;
