# syntax=docker/dockerfile:1
# outbox-relay container image: built in a Rust image, run from a slim Debian with only
# the shared libraries the binary links (OpenSSL, zlib) and CA certificates.
#
#   docker build -t outbox-relay .
#   docker run --rm -v $PWD/relay.toml:/etc/outbox-relay/relay.toml:ro outbox-relay
#
# The relay drains on SIGTERM within shutdown.drain_timeout (25s by default): give the
# container a stop timeout above it (docker stop -t 40; Kubernetes
# terminationGracePeriodSeconds, see examples/kubernetes-sidecar.yaml).

FROM rust:1-bookworm AS build
# libcurl4-openssl-dev: the bundled librdkafka includes curl/curl.h even with curl off.
# Debian's security updates replace package versions: pinning them breaks rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake libcurl4-openssl-dev libssl-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The release profile keeps line tables (94 MB with librdkafka's); the image gets the
# binary without debug info (symbols stay, for panic backtraces), and the debug info is
# kept beside it in this stage: docker build --target build, /out/outbox-relay.debug.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin outbox-relay \
 && install -D -m 0755 target/release/outbox-relay /out/outbox-relay \
 && objcopy --only-keep-debug /out/outbox-relay /out/outbox-relay.debug \
 && strip --strip-debug /out/outbox-relay \
 && objcopy --add-gnu-debuglink=/out/outbox-relay.debug /out/outbox-relay

FROM debian:bookworm-slim
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/outbox-relay /usr/local/bin/outbox-relay
COPY config/relay.example.toml /etc/outbox-relay/relay.example.toml
# A numeric non-root user: Kubernetes runAsNonRoot can verify it without a passwd entry.
USER 65532:65532
ENV RUST_LOG=info
STOPSIGNAL SIGTERM
ENTRYPOINT ["outbox-relay"]
CMD ["run", "--log-format", "json"]
