# outbox-relay container image.
#   docker build -t outbox-relay .
#   docker run --read-only -e OUTBOX_TENANTS=acme -e OUTBOX_DATABASE_URL=... -e OUTBOX_AMQP_URL=... -p 9780:9780 outbox-relay

FROM rust:1.88-slim-bookworm AS builder
WORKDIR /build

# Dependencies first, in their own layer: rebuilt only when Cargo.toml or
# Cargo.lock change. Cargo refuses a manifest whose declared [[bench]], [[test]]
# or [[example]] has no source file, so each gets an empty stand-in (none of
# them is built or shipped; the stand-ins stay for the second build).
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && awk -F'"' '/^\[/ { dir = "" } /^\[\[bench\]\]/ { dir = "benches" } /^\[\[test\]\]/ { dir = "tests" } /^\[\[example\]\]/ { dir = "examples" } dir != "" && /^name *=/ { print dir "/" $2 ".rs" } dir != "" && /^path *=/ { print $2 }' Cargo.toml \
       | while read -r stub; do mkdir -p "$(dirname "$stub")" && echo 'fn main() {}' > "$stub"; done \
    && cargo build --release --locked \
    && rm -rf src

# The relay itself. src/migrate.rs embeds ../migrations with include_str!.
COPY src ./src
COPY migrations ./migrations
# Shipped stripped (about a fifth of the size); the debug information is kept
# beside it, linked by name, in the `debuginfo` stage:
#   docker build --target debuginfo --output type=local,dest=. .
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked \
    && cp target/release/outbox-relay /outbox-relay \
    && objcopy --only-keep-debug /outbox-relay /outbox-relay.debug \
    && strip --strip-debug --strip-unneeded /outbox-relay \
    && objcopy --add-gnu-debuglink=/outbox-relay.debug /outbox-relay

# The debug information of the shipped binary, for symbolising a crash.
FROM scratch AS debuginfo
COPY --from=builder /outbox-relay.debug /outbox-relay.debug

# glibc, libgcc and CA certificates (for sslmode=verify-full and amqps://), no shell.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /outbox-relay /usr/local/bin/outbox-relay
COPY migrations /app/migrations
# An example only: it points at 127.0.0.1, so the image does not pass --config.
# Configure with OUTBOX_* variables, or mount a file and add --config PATH.
COPY config/outbox-relay.toml /app/config/outbox-relay.toml
WORKDIR /app
USER 65532:65532
ENV OUTBOX_HTTP_ADDR=0.0.0.0:9780 \
    OUTBOX_LOG_FORMAT=json
EXPOSE 9780
# Writes nothing to disk: runs with a read-only root file system.
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run"]
