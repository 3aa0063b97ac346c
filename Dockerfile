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
# Debian's security updates replace package versions: pinning them breaks rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake libssl-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin outbox-relay \
 && install -D -m 0755 target/release/outbox-relay /out/outbox-relay

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
